//! The `flare` binary as a user meets it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;

fn flare() -> Command {
    Command::new(env!("CARGO_BIN_EXE_flare"))
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cores").join(name)
}

#[test]
fn check_prints_summary() {
    for (name, abi) in [("abi3", "3"), ("abi2", "2"), ("abi1", "1")] {
        let out = flare().arg("check").arg(fixture(name)).output().unwrap();
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(out.status.success(), "{stdout}");
        assert!(stdout.contains(&format!("execution ABI      {abi}")), "{stdout}");
        assert!(stdout.contains("decode buckets     [1, 2, 4]"), "{stdout}");
        assert!(stdout.contains("kv pages"), "{stdout}");
        assert!(stdout.contains("prefill            T=64"), "{stdout}");
        // Speculative programs arrived with ABI 3.
        assert_eq!(stdout.contains("speculative        B=1 D=3, B=2 D=3, B=4 D=1"), abi == "3", "{stdout}");
    }
}

#[test]
fn check_names_the_broken_field() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("abi2");
    for entry in ["manifest.pb", "frontend", "kernels", "payloads"] {
        copy(&src.join(entry), &dir.path().join(entry));
    }
    std::fs::write(dir.path().join("kernels/k1.cubin"), b"tampered").unwrap();
    let out = flare().arg("check").arg(dir.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("core.kernels[id=1].sha256"), "{stderr}");
}

/// Without a GPU (CI), a real core cannot be served: the CUDA build says why (no driver, or a
/// device the core's kernels do not fit), a build without CUDA says it has no executor, and
/// neither binds the port.
#[test]
fn run_real_core_without_a_gpu_binds_nothing() {
    let port = free_port();
    let out = flare().args(["run", "--port", &port.to_string()]).arg(fixture("abi2")).output().unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    if cfg!(feature = "cuda") {
        assert_eq!(out.status.code(), Some(4), "{stderr}");
        assert!(stderr.contains("startup failed: executor:"), "{stderr}");
    } else {
        assert_eq!(out.status.code(), Some(3));
        assert!(stderr.contains("no CUDA executor"), "{stderr}");
    }
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[test]
fn failed_startup_binds_nothing() {
    let port = free_port();
    let out = flare().args(["run", "--max-model-len", "999999", "--port", &port.to_string()]).output().unwrap();
    assert_eq!(out.status.code(), Some(4));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("--max-model-len 999999 outside"), "{stderr}");
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}

/// A simulated step time asks for the simulated executor: with a real core (and no `--sim`) it
/// is a startup error, before the core is loaded.
#[test]
fn sim_step_time_needs_the_simulated_executor() {
    let port = free_port();
    let out = flare()
        .args(["run", "--sim-step-us", "2000", "--port", &port.to_string()])
        .arg(fixture("abi2"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("--sim-step-us applies only to the simulated executor"), "{stderr}");
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn copy(from: &std::path::Path, to: &std::path::Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            copy(&e.path(), &to.join(e.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap();
    }
}

#[test]
fn run_help_lists_the_connection_limits() {
    let out = flare().args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{help}");
    for flag in [
        "--max-connections",
        "--header-read-timeout-secs",
        "--body-read-timeout-secs",
        "--idle-timeout-secs",
        "--write-stall-timeout-secs",
        "--allowed-hosts",
        "--shutdown-grace-secs",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    assert!(
        help.contains("[default: 10]") && help.contains("[default: 30]") && help.contains("[default: 60]"),
        "{help}"
    );
    // Zero would disable a limit by accident: refused before anything starts.
    let out = flare().args(["run", "--idle-timeout-secs", "0"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}
