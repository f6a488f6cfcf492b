//! Temporary files and directories of long jobs (model writes, spilled runs, import records)
//! and the safe removal of the ones a killed job left behind.
//!
//! Every scratch entry is named `.dart-ngram-…` and holds an exclusive `flock` for as long as
//! its job lives (a temporary file locks itself, a directory a `lock` file inside it). The
//! kernel drops the lock when the process dies, however it dies, so a later job can tell a
//! leftover (lock free) from the scratch of a job still running (lock held) and removes only
//! the former, and only once it is [`STALE_AFTER`] old (a new entry is created a moment before
//! it is locked).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::error::{NGramError, Result};

/// Prefix of every scratch file and directory.
pub const PREFIX: &str = ".dart-ngram-";
/// Suffix of scratch files.
pub const SUFFIX: &str = ".tmp";
/// Name of the lock file inside a scratch directory.
const LOCK: &str = "lock";
/// Age below which an unlocked entry is left alone (it may be being created).
pub const STALE_AFTER: Duration = Duration::from_secs(60);

fn locked(file: &File, path: &Path) -> Result<()> {
    file.try_lock().map_err(|e| {
        NGramError::io(
            path,
            std::io::Error::other(format!("cannot lock a new scratch file: {e}")),
        )
    })
}

/// A new scratch file `.dart-ngram-<kind>-XXXXXX.tmp` in `dir`, locked until dropped or
/// persisted (the lock goes with the open file).
pub fn tempfile(dir: &Path, kind: &str) -> Result<tempfile::NamedTempFile> {
    let tmp = tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{kind}-"))
        .suffix(SUFFIX)
        .tempfile_in(dir)
        .map_err(|e| NGramError::io(dir, e))?;
    locked(tmp.as_file(), tmp.path())?;
    Ok(tmp)
}

/// A new scratch directory `.dart-ngram-<kind>-XXXXXX` in `dir`, removed when dropped; the
/// returned file is its lock, to keep open as long as the directory is in use.
pub fn tempdir(dir: &Path, kind: &str) -> Result<(tempfile::TempDir, File)> {
    let d = tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{kind}-"))
        .tempdir_in(dir)
        .map_err(|e| NGramError::io(dir, e))?;
    let lock_path = d.path().join(LOCK);
    let lock = File::create(&lock_path).map_err(|e| NGramError::io(&lock_path, e))?;
    locked(&lock, &lock_path)?;
    Ok((d, lock))
}

/// Whether no live job holds the lock of the scratch entry `path` (a file, or a directory with
/// a lock file) and it is old enough. Entries without a lock are never called stale.
fn is_stale(path: &Path, meta: &std::fs::Metadata, now: SystemTime) -> bool {
    let old = meta
        .modified()
        .ok()
        .and_then(|m| now.duration_since(m).ok())
        .is_some_and(|age| age >= STALE_AFTER);
    if !old {
        return false;
    }
    let lock_path = if meta.is_dir() {
        path.join(LOCK)
    } else {
        path.to_path_buf()
    };
    // Opening read-only is enough for flock; the lock is released when `f` is dropped.
    match File::open(&lock_path) {
        Ok(f) => f.try_lock().is_ok(),
        Err(_) => false,
    }
}

/// Removes, from `dir`, the scratch entries earlier jobs left behind (killed before they could
/// clean up): only ours (named `.dart-ngram-…`), only unlocked ones older than
/// [`STALE_AFTER`]. Best effort: what cannot be read or removed is left. Returns what was
/// removed.
pub fn clean_stale(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return removed;
    };
    let now = SystemTime::now();
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with(PREFIX) {
            continue;
        }
        // symlink_metadata: never follow a link out of `dir`.
        let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        let ours = if meta.is_dir() {
            true
        } else {
            meta.is_file() && name.ends_with(SUFFIX)
        };
        if !ours || !is_stale(&e.path(), &meta, now) {
            continue;
        }
        let gone = if meta.is_dir() {
            std::fs::remove_dir_all(e.path())
        } else {
            std::fs::remove_file(e.path())
        };
        if gone.is_ok() {
            removed.push(e.path());
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn age(path: &Path, secs: u64) {
        let t = SystemTime::now() - Duration::from_secs(secs);
        let f = File::options().write(true).open(path).unwrap();
        f.set_modified(t).unwrap();
    }

    #[test]
    fn only_dead_old_scratch_of_ours_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // A live job's file and directory: locked, old, kept.
        let live = tempfile(d, "write").unwrap();
        age(live.path(), 3600);
        let (live_dir, _lock) = tempdir(d, "runs").unwrap();
        std::fs::File::open(live_dir.path())
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(3600))
            .unwrap();
        // A killed job's: unlocked once their handles are gone (kept on disk with keep()).
        let dead = tempfile(d, "write")
            .unwrap()
            .into_temp_path()
            .keep()
            .unwrap();
        age(&dead, 3600);
        let (dead_dir, lock) = tempdir(d, "runs").unwrap();
        drop(lock);
        let dead_dir = dead_dir.keep();
        std::fs::write(dead_dir.join("run-0"), b"x").unwrap();
        File::open(&dead_dir)
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(3600))
            .unwrap();
        // Dead but fresh (maybe being created): kept. Not ours: kept.
        let fresh = tempfile(d, "write")
            .unwrap()
            .into_temp_path()
            .keep()
            .unwrap();
        let foreign = d.join(".other.tmp");
        std::fs::write(&foreign, b"x").unwrap();
        age(&foreign, 3600);
        let no_lock = d.join(".dart-ngram-runs-old");
        std::fs::create_dir(&no_lock).unwrap();
        File::open(&no_lock)
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(3600))
            .unwrap();

        let mut removed = clean_stale(d);
        removed.sort();
        let mut expect = vec![dead.clone(), dead_dir.clone()];
        expect.sort();
        assert_eq!(removed, expect);
        assert!(live.path().exists() && live_dir.path().exists());
        assert!(fresh.exists() && foreign.exists() && no_lock.exists());
        assert!(!dead.exists() && !dead_dir.exists());
    }
}
