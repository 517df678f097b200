//! The `kvq` command-line tool: [`kvq::cli`] on the process's arguments.

fn main() -> std::process::ExitCode {
    kvq::cli::main()
}
