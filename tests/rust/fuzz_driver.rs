//! The fuzz driver's watchdog (`tests/rust/common/fuzz.rs`): an input that runs over
//! `LORAFAST_FUZZ_HANG_SECS` ends the run and is saved as `hang-<hash>`; inputs under the limit,
//! however many, pass. The driver ends the whole process on a hang, so each case runs this test
//! binary again as a child, with a corpus root in a temporary folder.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use proptest::strategy::Just;

/// Set in the child: which target `child_target` drives ("hang" or "quick").
const CHILD: &str = "LORAFAST_FUZZ_DRIVER_CHILD";
const INPUT: &[u8] = b"an input that hangs";

/// The child's side; does nothing unless run by the tests below.
#[test]
fn child_target() {
    match std::env::var(CHILD).as_deref() {
        // One input that sleeps far past the limit.
        Ok("hang") => {
            common::fuzz::drive("watchdog", 1, Just(INPUT.to_vec()), |_| {
                std::thread::sleep(Duration::from_secs(60));
                Ok(())
            });
        }
        // Many inputs, each well under the limit, together well over it.
        Ok("quick") => {
            let ran = common::fuzz::drive("watchdog", 30, Just(INPUT.to_vec()), |_| {
                std::thread::sleep(Duration::from_millis(20));
                Ok(())
            });
            assert_eq!(ran.generated, 30);
        }
        _ => {}
    }
}

fn run_child(mode: &str, root: &Path) -> Output {
    Command::new(std::env::current_exe().expect("the test binary's path"))
        .args(["child_target", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, mode)
        .env("LORAFAST_FUZZ_HANG_SECS", "0.3")
        .env("LORAFAST_FUZZ_CORPUS", root)
        .env_remove("LORAFAST_FUZZ_CASES")
        .output()
        .expect("run the test binary as a child")
}

fn temp_root(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("lorafast-fuzz-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    root
}

fn saved(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| {
                    let bytes = std::fs::read(e.path()).expect("read a saved input");
                    (e.file_name().to_string_lossy().into_owned(), bytes)
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

#[test]
fn watchdog_saves_and_fails_a_hanging_input() {
    let root = temp_root("hang");
    let started = Instant::now();
    let out = run_child("hang", &root);
    let elapsed = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the child passed: {stderr}");
    assert!(elapsed < Duration::from_secs(30), "the child ran {elapsed:?}");
    assert!(stderr.contains("over the hang limit of 0.300 s"), "{stderr}");
    let files = saved(&root.join("watchdog"));
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].0.starts_with("hang-"), "{files:?}");
    assert_eq!(files[0].1, INPUT);
    assert!(stderr.contains(&files[0].0), "{stderr}");
}

#[test]
fn watchdog_lets_inputs_under_the_limit_pass() {
    let root = temp_root("quick");
    let out = run_child("quick", &root);
    let files = saved(&root.join("watchdog"));
    let _ = std::fs::remove_dir_all(&root);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(files.is_empty(), "{files:?}");
}
