//! Runtime drivers for space sandboxes and the template store on disk.

pub mod gvisor;
pub mod template;
