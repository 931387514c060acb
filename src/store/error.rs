//! The store's one error type, `StoreError`: every message names the file or directory,
//! and the SQLite or I/O cause is kept as the error's source.

use std::error::Error as StdError;
use std::io;
use std::path::{Path, PathBuf};

use rusqlite::ErrorCode;

use crate::pci::Generation;

/// A cause that may come from SQLite or from the filesystem (the lock file, the state
/// directory), kept boxed so the variants that can arise from either stay one variant.
pub type Cause = Box<dyn StdError + Send + Sync + 'static>;

/// Why the store refused or failed an operation.
///
/// Display strings are sentences without the cause; print the chain (`{:#}` with anyhow,
/// or walk `source()`) to see SQLite's or the kernel's words.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Another process (a second hostdevd, or a tool that takes the same lock) holds the
    /// state directory. Two daemons on one ledger would hand out the same device twice.
    #[error(
        "state directory {} is locked by another hostdevd ({holder}); \
         only one daemon may own a state directory",
        dir.display()
    )]
    Locked {
        dir: PathBuf,
        /// What the lock file says about the holder, e.g. "pid 1234", or "pid unknown".
        holder: String,
        #[source]
        source: nix::errno::Errno,
    },

    /// The database failed its integrity check or does not look like a database. It is
    /// left exactly as found: replacing it would silently drop every claim it holds.
    #[error(
        "state database {} is corrupt ({reason}); it was left untouched: restore it from a \
         backup or move it aside deliberately before starting hostdevd",
        path.display()
    )]
    Corrupt {
        path: PathBuf,
        reason: String,
        #[source]
        source: Option<rusqlite::Error>,
    },

    /// The database carries a schema version this build does not know.
    #[error(
        "state database {} was written by a newer hostdevd (schema {found}, this build knows \
         up to {known}); it was left untouched",
        path.display()
    )]
    NewerSchema {
        path: PathBuf,
        found: i64,
        known: i64,
    },

    /// The filesystem is full. The transaction was rolled back; nothing of the batch was
    /// written and the store stays usable once space is freed.
    #[error(
        "no space left on the filesystem of {} while {op}; nothing was written",
        path.display()
    )]
    Full {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: Cause,
    },

    /// The state directory or database cannot be written (read-only mount, permissions).
    /// The transaction, if any, was rolled back.
    #[error(
        "cannot write {} while {op}: the file or its filesystem is read-only; nothing was \
         written",
        path.display()
    )]
    ReadOnly {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: Cause,
    },

    /// A batch would move the host generation backwards (invariant I5); nothing of it
    /// was written.
    #[error(
        "refusing to move the host generation of {} backwards from {stored} to {proposed}; \
         nothing was written",
        path.display()
    )]
    BackwardsGeneration {
        path: PathBuf,
        stored: Generation,
        proposed: Generation,
    },

    /// A value cannot be stored (does not fit an SQLite integer, or fails to encode).
    #[error("cannot store {what} in {}: {reason}", path.display())]
    Encode {
        path: PathBuf,
        what: String,
        reason: String,
        #[source]
        source: Option<serde_json::Error>,
    },

    /// The key is managed by the store itself and cannot be set through `meta_set`.
    #[error("meta key {key:?} of {} is reserved for the store", path.display())]
    ReservedKey { path: PathBuf, key: String },

    /// Any other filesystem failure.
    #[error("I/O on {} failed while {op}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },

    /// The disk failed (an I/O error) while a commit was being made durable: its pages
    /// and commit mark may be in the write-ahead log, or may not, so whether the commit
    /// stands is unknown until the database is opened again and its log read back.
    #[error(
        "the disk failed while committing to {}: whether the commit was made durable is unknown until the database is opened again",
        path.display()
    )]
    CommitUnknown {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },

    /// Any other SQLite failure.
    #[error("SQLite failed on {} while {op}", path.display())]
    Sqlite {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: rusqlite::Error,
    },
}

impl StoreError {
    /// The file or directory the error is about.
    pub fn path(&self) -> &Path {
        match self {
            StoreError::Locked { dir, .. } => dir,
            StoreError::Corrupt { path, .. }
            | StoreError::NewerSchema { path, .. }
            | StoreError::Full { path, .. }
            | StoreError::ReadOnly { path, .. }
            | StoreError::BackwardsGeneration { path, .. }
            | StoreError::Encode { path, .. }
            | StoreError::ReservedKey { path, .. }
            | StoreError::Io { path, .. }
            | StoreError::CommitUnknown { path, .. }
            | StoreError::Sqlite { path, .. } => path,
        }
    }

    /// True when a commit failed in a way that leaves its outcome unknown (see
    /// [`StoreError::CommitUnknown`]).
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, StoreError::CommitUnknown { .. })
    }

    /// True when the filesystem is full: retrying after space is freed can succeed.
    pub fn is_disk_full(&self) -> bool {
        matches!(self, StoreError::Full { .. })
    }

    /// True when the state directory or database cannot be written.
    pub fn is_read_only(&self) -> bool {
        matches!(self, StoreError::ReadOnly { .. })
    }

    /// True when the database is damaged or not a database.
    pub fn is_corrupt(&self) -> bool {
        matches!(self, StoreError::Corrupt { .. })
    }

    /// True when the failure is about the environment (space, a read-only mount) rather
    /// than the data: the same batch may succeed later on the same store.
    pub fn is_transient(&self) -> bool {
        self.is_disk_full() || self.is_read_only()
    }

    /// Classifies a SQLite error: full disk, read-only and corruption get their own
    /// variants so the daemon can tell the operator what to fix.
    pub(crate) fn sqlite(path: &Path, op: &'static str, source: rusqlite::Error) -> StoreError {
        let path = path.to_path_buf();
        match source.sqlite_error_code() {
            Some(ErrorCode::DiskFull) => StoreError::Full {
                path,
                op,
                source: Box::new(source),
            },
            Some(ErrorCode::ReadOnly) => StoreError::ReadOnly {
                path,
                op,
                source: Box::new(source),
            },
            Some(ErrorCode::DatabaseCorrupt) => StoreError::Corrupt {
                path,
                reason: format!("SQLite found a malformed page while {op}"),
                source: Some(source),
            },
            Some(ErrorCode::NotADatabase) => StoreError::Corrupt {
                path,
                reason: format!("it is not an SQLite database, found while {op}"),
                source: Some(source),
            },
            _ => StoreError::Sqlite { path, op, source },
        }
    }

    /// Classifies a filesystem error the same way: ENOSPC is full, EROFS and EACCES are
    /// read-only.
    pub(crate) fn io(path: &Path, op: &'static str, source: io::Error) -> StoreError {
        let path = path.to_path_buf();
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => StoreError::Full {
                path,
                op,
                source: Box::new(source),
            },
            Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM) => StoreError::ReadOnly {
                path,
                op,
                source: Box::new(source),
            },
            _ => StoreError::Io { path, op, source },
        }
    }

    pub(crate) fn corrupt(path: &Path, reason: impl Into<String>) -> StoreError {
        StoreError::Corrupt {
            path: path.to_path_buf(),
            reason: reason.into(),
            source: None,
        }
    }
}
