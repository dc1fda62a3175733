//! Builds the web console (`console/` at the repository root) and embeds it.
//!
//! `npm ci` installs its pinned packages (xterm.js, esbuild) when `node_modules` is
//! missing or older than the lock file; `node build.mjs` bundles it into `OUT_DIR`;
//! `console_assets.rs` lists every file there for `include_bytes!`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let console = manifest.join("../../console");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("console");
    for watched in ["src", "package.json", "package-lock.json", "build.mjs"] {
        println!("cargo:rerun-if-changed={}", console.join(watched).display());
    }
    let lock = console.join("package-lock.json");
    let installed = console.join("node_modules/.package-lock.json");
    if modified(&installed) < modified(&lock) {
        run(Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(&console));
    }
    let _ = std::fs::remove_dir_all(&out);
    run(Command::new("node")
        .arg("build.mjs")
        .arg(&out)
        .current_dir(&console));

    let mut files: Vec<_> = std::fs::read_dir(&out)
        .expect("the console's build wrote nothing")
        .map(|e| e.expect("read the console's build").path())
        .collect();
    files.sort();
    let mut table = String::from("/// The console's files: (name, content type, bytes).\npub static ASSETS: &[(&str, &str, &[u8])] = &[\n");
    for path in &files {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a UTF-8 asset name");
        let kind = match path.extension().and_then(|e| e.to_str()) {
            Some("html") => "text/html; charset=utf-8",
            Some("js") => "text/javascript; charset=utf-8",
            Some("css") => "text/css; charset=utf-8",
            Some("svg") => "image/svg+xml",
            _ => "text/plain; charset=utf-8",
        };
        table.push_str(&format!(
            "    ({name:?}, {kind:?}, include_bytes!({:?})),\n",
            path.display().to_string()
        ));
    }
    table.push_str("];\n");
    std::fs::write(out.with_file_name("console_assets.rs"), table)
        .expect("write console_assets.rs");
}

/// When a file last changed; the epoch for one that does not exist.
fn modified(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(std::time::UNIX_EPOCH)
}

fn run(cmd: &mut Command) {
    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "building the web console needs node and npm (scripts/setup.sh installs them): {:?}: {e}",
            cmd.get_program()
        )
    });
    assert!(
        status.success(),
        "building the web console: {cmd:?} failed with {status}"
    );
}
