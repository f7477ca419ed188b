//! The sparse shadow file `classify` reads kohya `.alpha` scalars from.

use std::io;
use std::path::PathBuf;
#[cfg(not(target_os = "linux"))]
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;

/// A sparse local file holding a remote object's fetched bytes at their offsets (an
/// in-memory file on Linux, a removed-after-use temporary file elsewhere).
pub(super) struct Shadow {
    pub(super) path: PathBuf,
    _file: std::fs::File,
    remove: bool,
}

impl Shadow {
    pub(super) fn new(pieces: &[(u64, Bytes)]) -> io::Result<Shadow> {
        use std::os::unix::fs::FileExt;
        let shadow = Self::create()?;
        for (at, bytes) in pieces {
            shadow._file.write_all_at(bytes, *at)?;
        }
        Ok(shadow)
    }

    #[cfg(target_os = "linux")]
    fn create() -> io::Result<Shadow> {
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create takes a NUL-terminated name and returns a new descriptor we own.
        let fd = unsafe { libc::memfd_create(c"lorafast-alpha".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        Ok(Shadow {
            path: PathBuf::from(format!("/proc/self/fd/{fd}")),
            _file: file,
            remove: false,
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn create() -> io::Result<Shadow> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "lorafast-alpha-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        Ok(Shadow {
            path,
            _file: file,
            remove: true,
        })
    }
}

impl Drop for Shadow {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
