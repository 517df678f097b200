//! File input and output as every kvq tool does it: inputs read only when they are regular
//! files within a size bound, outputs written atomically (a temporary file, fsync, rename)
//! and never over one of the run's inputs unless forced; safetensors files of tensors.

#[doc(no_inline)]
pub use kvq_quant_core::io::{
    TensorFile, TensorInfo, check_output, read_regular_file, write_atomic, write_output, write_outputs,
};
