//! The walk on trees that broke it: deep enough to overflow a recursive walk's stack, and entries
//! that are no regular files (FIFOs, dangling links, link loops), each of which must get a row.

use std::fs;
use std::path::{Path, PathBuf};

use _core::scan::{discover, scan_paths, ScanOptions};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorafast-fs-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_adapter(path: &Path) {
    let mut header = br#"{"m.lora_A.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#.to_vec();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&[0; 4]);
    fs::write(path, bytes).unwrap();
}

/// Removes a tree bottom-up without recursion (`remove_dir_all` recurses once per level).
fn remove_deep(root: &Path, levels: usize) {
    let mut dir = root.to_path_buf();
    for _ in 0..levels {
        dir.push("d");
    }
    let _ = fs::remove_dir_all(&dir);
    while dir != root {
        dir.pop();
        let _ = fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_thousand_level_tree_is_walked_without_overflowing_a_stack() {
    let root = temp_dir("deep");
    let levels = 1000;
    let mut dir = root.clone();
    for i in 0..levels {
        dir.push("d");
        fs::create_dir(&dir).unwrap();
        if i % 250 == 0 {
            // Two files here: this folder is a plain folder, not a one-file adapter.
            write_adapter(&dir.join("a.safetensors"));
            write_adapter(&dir.join("b.safetensors"));
        }
    }
    write_adapter(&dir.join("bottom.safetensors"));
    for threads in [Some(1), Some(2)] {
        let rows = scan_paths(
            std::slice::from_ref(&root),
            true,
            ScanOptions::default(),
            threads,
            false,
        );
        let paths: Vec<PathBuf> = rows.iter().map(|r| r.as_ref().unwrap().target.path.clone()).collect();
        // Depth-first order: each level's files before the folders below it.
        let mut expected = Vec::new();
        let mut at = root.clone();
        for i in 0..levels {
            at.push("d");
            if i % 250 == 0 {
                expected.push(at.join("a.safetensors"));
                expected.push(at.join("b.safetensors"));
            }
        }
        // The bottom folder holds one file and no sub-folder: it is that adapter.
        expected.push(at.clone());
        assert_eq!(paths, expected);
    }
    assert_eq!(discover(std::slice::from_ref(&root), true).len(), 9);
    remove_deep(&root, levels);
}

#[test]
fn special_entries_named_like_adapters_each_get_a_row() {
    let root = temp_dir("special");
    write_adapter(&root.join("good.safetensors"));
    let fifo = root.join("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    std::os::unix::fs::symlink(root.join("nowhere"), root.join("dangling.safetensors")).unwrap();
    std::os::unix::fs::symlink("loop.safetensors", root.join("loop.safetensors")).unwrap();
    std::os::unix::fs::symlink("/dev/null", root.join("null.safetensors")).unwrap();
    // A symlinked folder is still not followed, whatever its name.
    fs::create_dir(root.join("real")).unwrap();
    std::os::unix::fs::symlink(root.join("real"), root.join("folder.safetensors")).unwrap();
    let rows = scan_paths(
        std::slice::from_ref(&root),
        true,
        ScanOptions::default(),
        Some(2),
        false,
    );
    let got: Vec<(String, &str)> = rows
        .iter()
        .map(|r| match r {
            Ok(a) => (a.target.path.file_name().unwrap().to_string_lossy().into_owned(), "ok"),
            Err(e) => (e.path().file_name().unwrap().to_string_lossy().into_owned(), e.code()),
        })
        .collect();
    let want = [
        ("dangling.safetensors", "dangling_link"),
        ("fifo.safetensors", "not_regular_file"),
        ("good.safetensors", "ok"),
        ("loop.safetensors", "symlink_loop"),
        ("null.safetensors", "not_regular_file"),
    ];
    let want: Vec<(String, &str)> = want.iter().map(|(p, c)| ((*p).to_owned(), *c)).collect();
    assert_eq!(got, want);
    fs::remove_dir_all(&root).unwrap();
}
