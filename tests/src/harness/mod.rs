//! Process orchestration for end-to-end runs. Every child is spawned with a parent-death signal,
//! so no process outlives the harness even if it is killed.

pub mod client;
pub mod conversation;
pub mod envoy;
pub mod extproc;
pub mod process;
pub mod stack;
pub mod stats;

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The workspace root (this crate lives in `<root>/tests`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A free TCP port on 127.0.0.1 (bound then released; the OS rarely reuses it at once).
pub fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
    Ok(l.local_addr()?.port())
}

/// The Envoy binary: `$KVROUTE_ENVOY_BIN`, else the one `./dev setup` installs in `.venv`.
pub fn envoy_bin() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("KVROUTE_ENVOY_BIN") {
        if !p.is_empty() {
            return Ok(PathBuf::from(p));
        }
    }
    let lib = workspace_root().join(".venv/lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|dir| {
        dir.flatten()
            .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
            .find(|p| p.exists())
    });
    found.with_context(|| {
        format!(
            "no Envoy binary under {}: run ./dev setup (or set KVROUTE_ENVOY_BIN)",
            lib.display()
        )
    })
}

/// The tokenizer + chat template directory `./dev setup` fetches.
pub fn model_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::var("KVROUTE_MODEL_DIR")
        .ok()
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".cache/models/qwen3"));
    anyhow::ensure!(
        dir.join("tokenizer.json").exists(),
        "no tokenizer.json in {}: run ./dev setup (or set KVROUTE_MODEL_DIR)",
        dir.display()
    );
    Ok(dir)
}

/// A workspace binary built next to the running executable (target/<profile>/NAME).
pub fn workspace_bin(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the current executable")?;
    // Test executables live in target/<profile>/deps; binaries in target/<profile>.
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let p = dir.join(name);
    anyhow::ensure!(
        p.exists(),
        "{} is not built: run `cargo build --bins` (./dev test does)",
        p.display()
    );
    Ok(p)
}
