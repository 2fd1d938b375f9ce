//! The hot-route simulator's own tests (scripts/test_sim_hot_routes.py), run with the rest of
//! the suite: docs/design/hot-routes.md rests its choice of design on the simulator's figures,
//! so a change that breaks its hand-computable cases must fail the build like any other test.
//! The simulator is Python's standard library only and deterministic for a given seed.

use std::path::Path;
use std::process::Command;

#[test]
fn the_hot_route_simulator_passes_its_own_tests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("python3")
        .args([
            "-m",
            "unittest",
            "discover",
            "-s",
            "scripts",
            "-p",
            "test_sim_hot_routes.py",
        ])
        .current_dir(&root)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 runs (Debian: apt-get install -y python3; scripts/test-deps installs it)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the simulator's tests failed:\n{stderr}"
    );
    // unittest prints "Ran N tests"; none found would pass silently otherwise.
    assert!(
        stderr.contains("Ran ") && !stderr.contains("Ran 0 tests"),
        "no simulator test ran:\n{stderr}"
    );
}
