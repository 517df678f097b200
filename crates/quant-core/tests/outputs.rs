//! Output paths that never clobber what they must not: devices, FIFOs, sockets, directories,
//! the command's own inputs, files the user cannot write; permissions kept; sets of outputs
//! written all or none.
#![cfg(unix)]

use std::io::ErrorKind;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use kvq_quant_core::io::{check_output, write_output, write_outputs};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvq-outputs-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

#[test]
fn new_files_take_the_umask_and_replaced_files_keep_their_permissions() {
    let d = dir("modes");
    let reference = d.join("reference");
    std::fs::File::create(&reference).unwrap();
    let new = d.join("new.toml");
    write_output(&new, b"a", &[], false).unwrap();
    assert_eq!(mode(&new), mode(&reference), "a new output gets what File::create gives");
    std::fs::set_permissions(&new, std::fs::Permissions::from_mode(0o640)).unwrap();
    write_output(&new, b"b", &[], false).unwrap();
    assert_eq!(std::fs::read(&new).unwrap(), b"b");
    assert_eq!(mode(&new), 0o640, "a replaced output keeps its permissions");
    let leftovers: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 2, "no temporary file left: {leftovers:?}");
}

#[test]
fn targets_that_are_not_regular_files_are_refused() {
    let d = dir("kinds");
    let refused = |p: &Path| {
        let e = write_output(p, b"x", &[], true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{}: {e}", p.display());
    };
    refused(&d);
    refused(Path::new("/dev/null"));
    let fifo = d.join("fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|s| s.success()) {
        refused(&fifo);
    } else {
        eprintln!("SKIPPED the FIFO case: no mkfifo here");
    }
    let socket = d.join("socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    refused(&socket);
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&std::fs::metadata(&socket).unwrap().file_type()));
}

#[test]
fn an_output_that_is_an_input_is_refused_by_any_name() {
    let d = dir("inputs");
    let input = d.join("calibration.json");
    std::fs::write(&input, b"input").unwrap();
    let hard = d.join("hard-link");
    std::fs::hard_link(&input, &hard).unwrap();
    let soft = d.join("soft-link");
    std::os::unix::fs::symlink(&input, &soft).unwrap();
    let dotted = d.join(".").join("calibration.json");
    for p in [&input, &hard, &soft, &dotted] {
        let e = write_output(p, b"output", &[input.as_path()], true).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{}", p.display());
        assert!(e.to_string().contains("input"), "{e}");
    }
    assert_eq!(std::fs::read(&input).unwrap(), b"input");
    // Another file is fine.
    write_output(&d.join("other"), b"output", &[input.as_path()], false).unwrap();
}

#[test]
fn a_read_only_file_is_replaced_only_with_force() {
    let d = dir("readonly");
    let p = d.join("config.toml");
    std::fs::write(&p, b"old").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o444)).unwrap();
    let e = write_output(&p, b"new", &[], false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied);
    assert!(e.to_string().contains("--force"), "{e}");
    assert_eq!(std::fs::read(&p).unwrap(), b"old");
    write_output(&p, b"new", &[], true).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"new");
    assert_eq!(mode(&p), 0o444);
    assert!(check_output(&d.join("absent"), &[], false).is_ok());
}

#[test]
fn a_set_of_outputs_is_written_all_or_none() {
    let d = dir("set");
    let a = d.join("a.svg");
    std::fs::write(&a, b"old a").unwrap();
    let blocked = d.join("b.svg");
    std::fs::create_dir(&blocked).unwrap();
    let files = vec![(a.clone(), b"new a".to_vec()), (blocked.clone(), b"new b".to_vec())];
    let (path, e) = write_outputs(&files, &[], false).unwrap_err();
    assert_eq!(path, blocked);
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert_eq!(std::fs::read(&a).unwrap(), b"old a", "nothing written when one output is refused");
    std::fs::remove_dir(&blocked).unwrap();
    write_outputs(&files, &[], false).unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), b"new a");
    assert_eq!(std::fs::read(&blocked).unwrap(), b"new b");
    let names: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
}
