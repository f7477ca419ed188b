//! Opening files that may be anything: a FIFO named `*.safetensors` would block `open` until a
//! writer comes, a device would feed endless bytes, and a dangling link would only say "not
//! found". Every file lorafast reads is opened here, without blocking, and checked with `fstat`
//! to be a regular file; other types, dangling links and link loops get their own error codes.

use std::fs::{self, File, Metadata};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{with_context, AdapterErrorCode, Error};

/// Opens `path` for reading with `O_NONBLOCK`, so that a FIFO cannot block; its type is not
/// checked yet. The flag is left set: reads of a regular file ignore it.
pub fn open_unchecked(path: &Path) -> io::Result<File> {
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

/// `open_unchecked` and `fstat`: the caller decides what to do with what is not a regular file.
pub fn open_nonblocking(path: &Path) -> io::Result<(File, Metadata)> {
    let file = open_unchecked(path)?;
    let meta = file.metadata()?;
    Ok((file, meta))
}

/// Opens the regular file at `path`; returns it with its size.
pub fn open_regular(path: &Path) -> Result<(File, u64), Error> {
    let (file, meta) = open_nonblocking(path).map_err(|e| open_error(path, e))?;
    if !meta.is_file() {
        return Err(not_regular(path, &meta));
    }
    Ok((file, meta.len()))
}

/// The error for a path that is there but is no regular file. A folder is the OS's own
/// `EISDIR` (Python's `IsADirectoryError`), as reading it would give.
pub fn not_regular(path: &Path, meta: &Metadata) -> Error {
    let t = meta.file_type();
    if t.is_dir() {
        return Error::io(path, io::Error::from_raw_os_error(libc::EISDIR));
    }
    let what = if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    };
    Error::adapter(
        path,
        AdapterErrorCode::NotRegularFile,
        format!("{what}, not a regular file; only regular files are read"),
    )
}

/// An `open` or `stat` failure, told apart further on the failure path only: a dangling link
/// from a missing file (one `lstat`), and a socket or a device without a driver (`ENXIO`,
/// `ENODEV`: one `stat`) from a real I/O error. A link loop is `ELOOP`, which `Error::code` names
/// `symlink_loop`.
pub fn open_error(path: &Path, e: io::Error) -> Error {
    if e.kind() == io::ErrorKind::NotFound && fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        let why = with_context("dangling symlink, its target does not exist", e);
        return Error::io_coded(path, AdapterErrorCode::DanglingLink, why);
    }
    if matches!(e.raw_os_error(), Some(libc::ENXIO | libc::ENODEV | libc::EOPNOTSUPP)) {
        if let Some(meta) = fs::metadata(path).ok().filter(|m| !m.is_file() && !m.is_dir()) {
            return not_regular(path, &meta);
        }
    }
    Error::io(path, e)
}

/// `stat` (following links) of an input path, with `open_error`'s codes.
pub fn stat(path: &Path) -> Result<Metadata, Error> {
    fs::metadata(path).map_err(|e| open_error(path, e))
}

/// The text of a small settings file (a token, an AWS config), read only if it is a regular file
/// (a FIFO there would block) and at most `max` bytes long; None otherwise.
pub fn read_small_text(path: &Path, max: u64) -> Option<String> {
    use std::io::Read;
    let (file, len) = open_regular(path).ok()?;
    if len > max {
        return None;
    }
    let mut text = String::new();
    file.take(max).read_to_string(&mut text).ok()?;
    Some(text)
}
