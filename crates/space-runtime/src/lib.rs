//! Runtime drivers for space sandboxes and the template store on disk.

pub mod build;
pub mod cpus;
mod debian;
pub mod disk;
pub mod guest;
pub mod gvisor;
pub mod import;
pub mod lend;
pub mod microvm;
pub mod net;
mod process;
pub mod template;
pub mod tree;

/// Total bytes of the regular files under `dir` (what a snapshot or a layer costs on disk).
pub fn dir_size(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}
