//! The durable ledger: one SQLite database (`hostdevd.db`, WAL, `synchronous=FULL`) in the
//! state directory, held under an exclusive `flock` for the store's life.
//!
//! The store persists what the ledger hands it as [`ChangeSet`]s and gives it back as a
//! [`Snapshot`] at start. Every [`Store::commit`] is one transaction, fsynced before it
//! returns (invariant I4): a batch of change sets is all on disk or none of it is. The host
//! generation it records never moves backwards (invariant I5).
//!
//! The store holds the whole request log, which it prunes itself (oldest first, past
//! [`Store::set_request_log_limit`]); the ledger keeps only the newest entries in memory
//! and asks [`Store::request`] for an older one. The log is appended in order, and found
//! by key through an index in memory (`request_index`).
//!
//! What the store refuses to do matters as much: a database that fails its integrity
//! check, was written by a newer build, or is missing while its write-ahead log is
//! present is reported and left byte for byte as found, its write-ahead log included.
//! It is never replaced, since a fresh database would silently free every device a VM
//! is using.
//!
//! A new database is built under a temporary name and renamed into place once its schema
//! is committed, so a `hostdevd.db` that exists is always a complete database: an empty
//! one is corruption, not a fresh start.

mod error;
mod request_index;
mod schema;
#[cfg(test)]
mod tests;

use std::borrow::Borrow;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use rusqlite::config::DbConfig;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension, TransactionBehavior};

use crate::ledger::model::{ChangeSet, DeviceRecord, Outcome, RequestEntry, Snapshot};
use crate::pci::{ConsumerId, Generation, RequestId};

pub use error::{Cause, StoreError};
use request_index::RequestIndex;
use schema::HOST_GENERATION_KEY;

/// The database file's name inside the state directory.
pub const DB_FILE: &str = "hostdevd.db";
/// The lock file's name inside the state directory. It holds the pid of the daemon that
/// owns the directory, for the error a second daemon prints; the lock is what counts.
pub const LOCK_FILE: &str = "hostdevd.lock";
/// Where a new database is built before it is renamed to [`DB_FILE`].
const NEW_DB_FILE: &str = "hostdevd.db.new";
/// The database file's mode (its log and index follow it).
const DB_MODE: u32 = 0o600;
/// How long a write waits for a reader that holds a lock (an operator's sqlite3 session)
/// before it fails. WAL readers never block our writes, so this only covers checkpoints.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// SQLite's page cache per connection, in KiB (`PRAGMA cache_size` takes it negated).
const CACHE_KIB: i64 = -1024;
/// The write-ahead log is copied back into the database (a checkpoint, with two fsyncs)
/// once it holds this many pages: 4 MiB at 4 KiB each, SQLite's default, set here so
/// that it is a decision. After a checkpoint the log is overwritten from its start, so
/// past its first 4 MiB a commit's fdatasync never has to record a new file size.
/// A longer log checkpoints less often but grows for longer: at 8000 pages, the
/// benchmark's 64 clients made 5.3x and 5.4x the one-client rate instead of 4.3x and
/// 4.5x (the same pages copied back fewer times), but a single claim's round trip went
/// from 1.52x and 1.59x of echo plus fsync to 1.81x and 1.92x (runs alternated), since
/// every commit of those first 32 MiB appended to the file.
const WAL_CHECKPOINT_PAGES: i64 = 1000;
/// How many prepared statements the connection keeps (rusqlite's default is 16).
const STATEMENT_CACHE: usize = 32;
/// How many `quick_check` complaints are quoted in a corruption error.
const MAX_CHECK_MESSAGES: usize = 3;
/// How many request-log entries the store keeps by default: the oldest tenth is pruned
/// past it. Each takes about 160 bytes of disk (UUID request ids, in full pages since the
/// log is appended), 16 MB at this default, and 8 bytes of memory in the index.
pub const DEFAULT_REQUEST_LOG_ENTRIES: usize = 100_000;

/// The schema version this build writes and understands.
pub fn schema_version() -> i64 {
    schema::current_version()
}

/// The durable ledger. Holds the state directory's lock and one SQLite connection; drop it
/// to release both.
pub struct Store {
    // Field order is drop order: the connection is closed (and the WAL checkpointed)
    // before the lock is released, so a successor never sees a half-closed database.
    conn: Connection,
    path: PathBuf,
    dir: PathBuf,
    /// How many request-log entries are kept.
    request_limit: u64,
    /// Where each request-log entry is, by a fingerprint of its key; also how many there
    /// are and the next entry's sequence number.
    requests: RequestIndex,
    /// Past how many entries the next prune is due: the limit, or further on after a
    /// prune failed (so that a failing prune is not retried at every commit).
    prune_at: u64,
    /// The durable host generation: the meta row's, or a record's where that is higher.
    /// A commit whose last generation one of its own records carries leaves the meta row
    /// alone (see [`Store::commit`]); `open` takes the larger of the two.
    host_generation: Generation,
    /// A failure the next commit reports (tests only).
    #[cfg(test)]
    fail_commit: std::cell::Cell<Option<i32>>,
    _lock: Flock<File>,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (creating if absent) the store in `state_dir`.
    ///
    /// Creates the directory (mode 0750) if needed, takes the exclusive lock, checks the
    /// database's schema version and integrity, and applies pending migrations. Fails with
    /// [`StoreError::Locked`] if another daemon holds the directory,
    /// [`StoreError::Corrupt`] or [`StoreError::NewerSchema`] without writing a byte, and
    /// [`StoreError::ReadOnly`] if the directory cannot be written.
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        create_state_dir(state_dir)?;
        let lock = lock_state_dir(state_dir)?;
        let path = state_dir.join(DB_FILE);
        match fs::metadata(&path) {
            Ok(meta) if meta.len() == 0 => {
                // Our databases are created complete and renamed into place, so an empty
                // file is a truncated database, not a new one.
                return Err(StoreError::corrupt(
                    &path,
                    "the file is empty; a database created by hostdevd never is",
                ));
            }
            Ok(meta) => {
                // A database made before the mode was set explicitly may be readable by
                // others: tighten it (its log and index follow when SQLite reopens them).
                if meta.permissions().mode() & 0o077 != 0 {
                    if let Err(e) = fs::set_permissions(&path, fs::Permissions::from_mode(DB_MODE))
                    {
                        tracing::warn!(path = %path.display(), error = %e, "cannot make the database owner-only");
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let wal = sibling(&path, "-wal");
                if fs::symlink_metadata(&wal).is_ok() {
                    // The log belongs to a database that was deleted; a new database would
                    // replay frames of the old one into itself.
                    return Err(StoreError::corrupt(
                        &path,
                        format!(
                            "the database is missing but its write-ahead log {} exists",
                            wal.display()
                        ),
                    ));
                }
                create_database(state_dir, &path)?;
            }
            Err(e) => return Err(StoreError::io(&path, "reading the database's metadata", e)),
        }
        // READ_WRITE without CREATE: the file was checked or created above, and if it
        // vanished since, failing beats starting empty.
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&path, flags)
            .map_err(|e| StoreError::sqlite(&path, "opening the database", e))?;
        // Until the database is accepted, closing the connection must not checkpoint:
        // SQLite's last connection copies the write-ahead log into the database and
        // deletes the log as it closes, which would change a refused database and lose
        // the log it was found with.
        checkpoint_on_close(&conn, &path, false)?;
        prepare_connection(&conn, &path)?;
        // Room for every statement the store prepares (17 now), so that the ones a
        // commit runs are never pushed out by a start-up or lookup query and parsed again.
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        let requests = index_requests(&conn, &path)?;
        // A database without a host generation cannot honour I5; say so at start rather
        // than at the first claim.
        let host_generation =
            read_host_generation(&conn, &path)?.max(newest_record_generation(&conn, &path)?);
        // Accepted: a clean stop leaves a closed database, its log copied in.
        checkpoint_on_close(&conn, &path, true)?;
        Ok(Store {
            conn,
            path,
            dir: state_dir.to_path_buf(),
            request_limit: DEFAULT_REQUEST_LOG_ENTRIES as u64,
            requests,
            prune_at: DEFAULT_REQUEST_LOG_ENTRIES as u64,
            #[cfg(test)]
            fail_commit: std::cell::Cell::new(None),
            host_generation,
            _lock: lock,
        })
    }

    /// Sets how many request-log entries are kept (at least 1). Once the log is past
    /// it, [`Self::prune_request_log`] deletes the oldest (the first logged).
    pub fn set_request_log_limit(&mut self, limit: usize) {
        self.request_limit = u64::try_from(limit.max(1)).unwrap_or(u64::MAX);
        self.prune_at = self.request_limit;
    }

    /// Whether the request log is past its limit, so [`Self::prune_request_log`] would
    /// prune.
    pub fn prune_due(&self) -> bool {
        self.request_log_len() > self.prune_at
    }

    /// If the request log is past its limit, deletes the oldest entries (the first
    /// logged), a tenth of the limit more than needed so that the next prune is that many
    /// entries away; returns whether it pruned. Its own transaction, apart from any
    /// commit: a prune that fails (a full disk: deleting writes pages too) loses nothing
    /// and blocks no commit, and is tried again a tenth of the limit later.
    pub fn prune_request_log(&mut self) -> Result<bool, StoreError> {
        if !self.prune_due() {
            return Ok(false);
        }
        let path = &self.path;
        let limit = self.request_limit;
        let rows = self.request_log_len();
        let excess = rows
            .saturating_sub(limit)
            .saturating_add(limit / 10)
            .min(rows);
        let next = self.requests.next_seq();
        let pruned = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| StoreError::sqlite(path, "pruning the request log", e))
            .and_then(|tx| {
                let keep_from = prune_requests(&tx, path, excess, next)?;
                tx.commit()
                    .map_err(|e| StoreError::sqlite(path, "pruning the request log", e))?;
                Ok(keep_from)
            });
        match pruned {
            Ok(keep_from) => {
                self.requests.forget_before(keep_from);
                self.prune_at = limit;
                Ok(true)
            }
            Err(e) => {
                self.prune_at = rows.saturating_add((limit / 10).max(1));
                Err(e)
            }
        }
    }

    /// How many request-log entries the store holds.
    pub fn request_log_len(&self) -> u64 {
        self.requests.len() as u64
    }

    /// One request's logged outcome, if the store holds it.
    pub fn request(
        &self,
        consumer: ConsumerId,
        request_id: &RequestId,
    ) -> Result<Option<RequestEntry>, StoreError> {
        let path = &self.path;
        let sql = |e| StoreError::sqlite(path, "looking up a request", e);
        let mut consumer_text = [0; uuid::fmt::Hyphenated::LENGTH];
        let consumer_text = consumer.as_text(&mut consumer_text);
        let fingerprint = self
            .requests
            .fingerprint(consumer_text, request_id.as_str());
        // Usually none; where one matches, almost always the entry itself.
        for seq in self.requests.candidates(fingerprint) {
            if let Some((c, r, outcome, at)) = self.request_row(seq).map_err(sql)? {
                if c == consumer_text && r == request_id.as_str() {
                    return decode_request(path, &c, &r, &outcome, at).map(Some);
                }
            }
        }
        Ok(None)
    }

    /// What an acting audit's attempts with id `audit` logged, one entry per orphan
    /// freed (`<audit>@<address>`, under the orphan's owner), oldest first: how a retry
    /// of the audit learns what an earlier attempt freed.
    pub fn audit_entries(&self, audit: &RequestId) -> Result<Vec<RequestEntry>, StoreError> {
        let path = &self.path;
        let sql = |e| StoreError::sqlite(path, "looking up an audit's frees", e);
        let fingerprint = self.requests.audit_fingerprint(audit.as_str());
        let mut found = Vec::new();
        for seq in self.requests.part_candidates(fingerprint) {
            if let Some((c, r, outcome, at)) = self.request_row(seq).map_err(sql)? {
                if RequestId::split_per_device(&r).is_some_and(|(a, _)| a == audit.as_str()) {
                    found.push(decode_request(path, &c, &r, &outcome, at)?);
                }
            }
        }
        Ok(found)
    }

    /// The request-log row logged under `seq`, if it is still there.
    fn request_row(&self, seq: i64) -> rusqlite::Result<Option<(String, String, String, i64)>> {
        self.conn
            .prepare_cached(schema::SELECT_REQUEST_AT)?
            .query_row([seq], |row| {
                Ok((
                    row.get::<_, String>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, String>(2)?,
                    row.get::<_, i64>(3)?,
                ))
            })
            .optional()
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The state directory this store owns.
    pub fn state_dir(&self) -> &Path {
        &self.dir
    }

    /// The host generation of the last committed batch (at least every stored record's).
    pub fn host_generation(&self) -> Result<Generation, StoreError> {
        Ok(self.host_generation)
    }

    /// Everything stored: host generation, device records and the request log (in the
    /// order logged). Every record is decoded and checked against its indexed columns; a
    /// disagreement is reported as corruption.
    pub fn load(&self) -> Result<Snapshot, StoreError> {
        self.load_recent(usize::MAX)
    }

    /// [`Self::load`] with only the newest `requests` entries of the request log (what
    /// the ledger keeps in memory; it asks the store for the others).
    pub fn load_recent(&self, requests: usize) -> Result<Snapshot, StoreError> {
        let path = &self.path;
        let sql = |e| StoreError::sqlite(path, "loading the ledger", e);
        // One read transaction, so the two reads see the same commit.
        let tx = self.conn.unchecked_transaction().map_err(sql)?;

        let mut records = std::collections::BTreeMap::new();
        // One present record an address: the agent never writes a second (it marks the
        // old one lost first), so two are a database changed by hand, and loading them
        // would leave one of the claims beyond any release.
        let mut present_at = std::collections::HashMap::new();
        let mut stmt = tx.prepare_cached(schema::SELECT_RECORDS).map_err(sql)?;
        let mut rows = stmt.query([]).map_err(sql)?;
        while let Some(row) = rows.next().map_err(sql)? {
            let columns = RecordColumns {
                id: row.get(0).map_err(sql)?,
                address: row.get(1).map_err(sql)?,
                generation: row.get(2).map_err(sql)?,
                present: row.get(3).map_err(sql)?,
                consumer: row.get(4).map_err(sql)?,
            };
            let json: String = row.get(5).map_err(sql)?;
            let record = decode_record(path, &columns, &json)?;
            if record.present {
                if let Some(other) = present_at.insert(record.address(), record.id) {
                    return Err(StoreError::corrupt(
                        path,
                        format!(
                            "records {} and {} are both present at {}",
                            other.0,
                            record.id.0,
                            record.address()
                        ),
                    ));
                }
            }
            records.insert(record.id, record);
        }
        drop(rows);
        drop(stmt);

        let limit = i64::try_from(requests).unwrap_or(-1);
        let mut requests = Vec::new();
        let mut stmt = tx
            .prepare_cached(schema::SELECT_NEWEST_REQUESTS)
            .map_err(sql)?;
        let mut rows = stmt.query([limit]).map_err(sql)?;
        // Newest first: an id logged twice (a retry of an entry already pruned) is the
        // newest one's, as a lookup finds it.
        let mut seen = std::collections::HashSet::new();
        while let Some(row) = rows.next().map_err(sql)? {
            let consumer: String = row.get(0).map_err(sql)?;
            let request_id: String = row.get(1).map_err(sql)?;
            let outcome: String = row.get(2).map_err(sql)?;
            let at: i64 = row.get(3).map_err(sql)?;
            let entry = decode_request(path, &consumer, &request_id, &outcome, at)?;
            if seen.insert((entry.consumer, entry.request_id.clone())) {
                requests.push(entry);
            }
        }
        requests.reverse();
        Ok(Snapshot {
            host_generation: self.host_generation,
            records,
            requests,
        })
    }

    /// Writes a batch of change sets as ONE durable transaction: upserts, removals,
    /// request entries and prunes of each change set in order, then the host generation
    /// of the last one. Returns only once the transaction is fsynced.
    ///
    /// The host generation's row is written only when no record of the batch carries
    /// that generation, or the batch removes a record. A claim, release or transfer
    /// gives its record the new host generation, so their batches leave the row alone:
    /// one page fewer in each commit's log, and a durable round trip about 2% shorter
    /// (see the README's benchmarks). The stored host generation is the larger of the
    /// row's and every record's, so it never goes backwards (I5): a record whose
    /// generation the row lacks is only ever replaced by a newer one of itself, or
    /// removed by a batch that writes the row.
    ///
    /// Refuses with [`StoreError::BackwardsGeneration`], writing nothing, if any change
    /// set's host generation is below the stored one or the one before it in the batch.
    /// On any error (a full disk, a read-only mount) the transaction is rolled back,
    /// nothing of the batch is on disk, and the store stays usable. Takes the change
    /// sets or references to them, so the writer need not copy a batch to commit it.
    pub fn commit<C: Borrow<ChangeSet>>(&mut self, batch: &[C]) -> Result<(), StoreError> {
        let Some(last) = batch.last().map(C::borrow) else {
            return Ok(());
        };
        let path = &self.path;
        let sql = |e| StoreError::sqlite(path, "committing a batch", e);
        // The request-log entries written, as (fingerprint, audit fingerprint, sequence
        // number): indexed once the transaction is durable.
        let mut logged: Vec<(u32, Option<u32>, i64)> = Vec::new();
        // IMMEDIATE takes the write lock up front, so a failure to get it surfaces here
        // and not halfway through the batch.
        let tx = WriteTx::begin(&self.conn).map_err(sql)?;
        let stored = self.host_generation;
        let mut running = stored;
        for cs in batch.iter().map(C::borrow) {
            if cs.host_generation < running {
                return Err(StoreError::BackwardsGeneration {
                    path: path.clone(),
                    stored,
                    proposed: cs.host_generation,
                });
            }
            running = cs.host_generation;
        }
        if running == stored && batch.iter().all(|cs| cs.borrow().is_empty()) {
            // Nothing to write: skip the fsync. Dropping `tx` ends it without a write.
            return Ok(());
        }
        let mut carried = Generation::default();
        let mut removes = false;
        {
            let conn = tx.conn;
            let mut upsert = conn.prepare_cached(schema::UPSERT_RECORD).map_err(sql)?;
            let mut fix_address = conn
                .prepare_cached(schema::FIX_RECORD_ADDRESS)
                .map_err(sql)?;
            let mut remove = conn.prepare_cached(schema::DELETE_RECORD).map_err(sql)?;
            let mut log = conn.prepare_cached(schema::INSERT_REQUEST).map_err(sql)?;
            for cs in batch.iter().map(C::borrow) {
                for record in &cs.upserts {
                    let json = serde_json::to_string(record).map_err(|e| StoreError::Encode {
                        path: path.clone(),
                        what: format!("record {}", record.id.0),
                        reason: "JSON encoding failed".into(),
                        source: Some(e),
                    })?;
                    let mut consumer_text = [0; uuid::fmt::Hyphenated::LENGTH];
                    let consumer = record
                        .claim
                        .as_ref()
                        .map(|c| c.owner.consumer.as_text(&mut consumer_text));
                    let id = to_sql_int(path, "record id", record.id.0)?;
                    let address = record.address().text();
                    let address = address.as_str();
                    upsert
                        .execute(params![
                            id,
                            address,
                            to_sql_int(path, "generation", record.generation.0)?,
                            record.present,
                            consumer,
                            json,
                        ])
                        .map_err(sql)?;
                    fix_address.execute(params![id, address]).map_err(sql)?;
                    carried = carried.max(record.generation);
                }
                removes |= !cs.removals.is_empty();
                for id in &cs.removals {
                    remove
                        .execute([to_sql_int(path, "record id", id.0)?])
                        .map_err(sql)?;
                }
                for entry in &cs.requests {
                    let outcome =
                        serde_json::to_string(&entry.outcome).map_err(|e| StoreError::Encode {
                            path: path.clone(),
                            what: format!(
                                "the outcome of request {} of {}",
                                entry.request_id, entry.consumer
                            ),
                            reason: "JSON encoding failed".into(),
                            source: Some(e),
                        })?;
                    let mut consumer_text = [0; uuid::fmt::Hyphenated::LENGTH];
                    let consumer = entry.consumer.as_text(&mut consumer_text);
                    let seq = self.requests.next_seq() + logged.len() as i64;
                    log.execute(params![
                        seq,
                        consumer,
                        entry.request_id.as_str(),
                        outcome,
                        to_sql_int(path, "request time", entry.at)?,
                    ])
                    .map_err(sql)?;
                    logged.push((
                        self.requests
                            .fingerprint(consumer, entry.request_id.as_str()),
                        self.requests.part_fingerprint(entry.request_id.as_str()),
                        seq,
                    ));
                }
            }
            if removes || last.host_generation > carried {
                let updated = conn
                    .prepare_cached(schema::UPDATE_HOST_GENERATION)
                    .map_err(sql)?
                    .execute([to_sql_int(path, "host generation", last.host_generation.0)?])
                    .map_err(sql)?;
                if updated != 1 {
                    return Err(StoreError::corrupt(
                        path,
                        "the meta table has no host_generation row",
                    ));
                }
            }
        }
        // If COMMIT fails (SQLITE_FULL while appending to the WAL), dropping the
        // transaction rolls it back, which also clears SQLite's error state so the next
        // commit starts clean. Auto-checkpoint failures after a successful COMMIT are
        // ignored by SQLite's default WAL hook. But an I/O error (a failed fsync above
        // all) may come after the commit mark is in the log: a later open reads the
        // commit back if the disk kept it, so its outcome is unknown, not "not
        // committed".
        #[cfg(test)]
        if let Some(code) = self.fail_commit.take() {
            drop(tx);
            let e = rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), None);
            return Err(commit_error(path, e));
        }
        tx.commit().map_err(|e| commit_error(path, e))?;
        for (fingerprint, part, seq) in logged {
            self.requests.add(fingerprint, part, seq);
        }
        self.host_generation = running.max(carried);
        Ok(())
    }

    /// Reads a meta value (e.g. `boot_id`). The host generation reads as its decimal text.
    pub fn meta_get(&self, key: &str) -> Result<Option<String>, StoreError> {
        if key == HOST_GENERATION_KEY {
            return Ok(Some(self.host_generation.0.to_string()));
        }
        let path = &self.path;
        let sql = |e| StoreError::sqlite(path, "reading a meta value", e);
        let mut stmt = self.conn.prepare_cached(schema::SELECT_META).map_err(sql)?;
        stmt.query_row([key], |row| row.get::<_, String>(0))
            .optional()
            .map_err(sql)
    }

    /// Durably sets a meta value. The host generation is reserved: only
    /// [`Store::commit`] writes it, so I5 is checked on every write.
    pub fn meta_set(&mut self, key: &str, value: &str) -> Result<(), StoreError> {
        if key == HOST_GENERATION_KEY {
            return Err(StoreError::ReservedKey {
                path: self.path.clone(),
                key: key.to_string(),
            });
        }
        let path = &self.path;
        let sql = |e| StoreError::sqlite(path, "writing a meta value", e);
        let mut stmt = self.conn.prepare_cached(schema::UPSERT_META).map_err(sql)?;
        stmt.execute([key, value]).map_err(sql)?;
        Ok(())
    }
}

/// Creates the state directory (and parents) with mode 0750 if it does not exist.
fn create_state_dir(dir: &Path) -> Result<(), StoreError> {
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(dir)
    {
        Ok(()) => Ok(()),
        Err(e) => Err(StoreError::io(dir, "creating the state directory", e)),
    }
}

/// Takes the exclusive, non-blocking lock on the state directory's lock file.
fn lock_state_dir(dir: &Path) -> Result<Flock<File>, StoreError> {
    let lock_path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o640)
        .open(&lock_path)
        .map_err(|e| StoreError::io(&lock_path, "opening the lock file", e))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => {
            // Best effort, for the message a second daemon prints. A fixed width lets us
            // overwrite in place without truncating, so even a full disk (no new block
            // needed) does not stop a restart; a failure here changes nothing that counts.
            let _ = lock.write_at(format!("{:<20}\n", std::process::id()).as_bytes(), 0);
            Ok(lock)
        }
        Err((mut file, errno)) if errno == Errno::EWOULDBLOCK => {
            let mut text = String::new();
            let holder = match file.read_to_string(&mut text) {
                Ok(_) => match text.trim().parse::<u32>() {
                    Ok(pid) => format!("pid {pid}"),
                    Err(_) => "pid unknown".to_string(),
                },
                Err(_) => "pid unknown".to_string(),
            };
            Err(StoreError::Locked {
                dir: dir.to_path_buf(),
                holder,
                source: errno,
            })
        }
        Err((_, errno)) => Err(StoreError::io(
            &lock_path,
            "locking the state directory",
            io::Error::from(errno),
        )),
    }
}

/// Builds a new database under [`NEW_DB_FILE`], fully migrated and fsynced, then renames
/// it to `path` and fsyncs the directory. A crash at any point leaves either no
/// `hostdevd.db` or a complete one.
fn create_database(dir: &Path, path: &Path) -> Result<(), StoreError> {
    let tmp = dir.join(NEW_DB_FILE);
    // Leftovers of a creation that crashed: they never held acknowledged data, because
    // the daemon only serves from the renamed database.
    for suffix in ["", "-journal", "-wal", "-shm"] {
        let leftover = sibling(&tmp, suffix);
        match fs::remove_file(&leftover) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io(&leftover, "removing a leftover file", e)),
        }
    }
    // The ledger names every consumer on this host: owner-only, whatever the umask.
    // SQLite gives its journal, write-ahead log and index the database file's mode.
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(DB_MODE)
        .open(&tmp)
        .map_err(|e| StoreError::io(&tmp, "creating the database", e))?;
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(&tmp, flags)
        .map_err(|e| StoreError::sqlite(&tmp, "creating the database", e))?;
    // A rollback journal while building: once the connection closes, everything is in
    // the one file that gets renamed (a WAL would have to travel with it).
    conn.pragma_update(None, "journal_mode", "DELETE")
        .map_err(|e| StoreError::sqlite(&tmp, "creating the database", e))?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(|e| StoreError::sqlite(&tmp, "creating the database", e))?;
    migrate(&conn, &tmp, 0)?;
    conn.close()
        .map_err(|(_, e)| StoreError::sqlite(&tmp, "closing the new database", e))?;
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| StoreError::io(&tmp, "syncing the new database", e))?;
    fs::rename(&tmp, path).map_err(|e| StoreError::io(path, "renaming the new database", e))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(dir, "syncing the state directory", e))?;
    Ok(())
}

/// A batch's write transaction, begun and committed with statements SQLite parsed once
/// for the connection (rusqlite's `Transaction` parses `BEGIN` and `COMMIT` afresh each
/// time, a few microseconds of every lone change). Rolled back when dropped uncommitted:
/// a statement that failed, or a `COMMIT` that did (which also clears SQLite's error
/// state, so the next batch starts clean).
struct WriteTx<'c> {
    conn: &'c Connection,
    open: bool,
}

impl<'c> WriteTx<'c> {
    fn begin(conn: &'c Connection) -> rusqlite::Result<WriteTx<'c>> {
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        Ok(WriteTx { conn, open: true })
    }

    fn commit(mut self) -> rusqlite::Result<()> {
        self.conn.prepare_cached("COMMIT")?.execute([])?;
        self.open = false;
        Ok(())
    }
}

impl Drop for WriteTx<'_> {
    fn drop(&mut self) {
        // After a failed COMMIT SQLite may have rolled back already (the connection is
        // then in autocommit mode, and a ROLLBACK would fail): only an open one is ended.
        if self.open && !self.conn.is_autocommit() {
            if let Err(e) = self.conn.execute_batch("ROLLBACK") {
                tracing::warn!(error = %e, "rolling back a batch that was not committed failed");
            }
        }
    }
}

/// A failed COMMIT: an I/O error leaves its outcome unknown; anything else (a full disk,
/// a read-only file) means it was not committed.
fn commit_error(path: &Path, e: rusqlite::Error) -> StoreError {
    if e.sqlite_error_code() == Some(rusqlite::ErrorCode::SystemIoFailure) {
        return StoreError::CommitUnknown {
            path: path.to_path_buf(),
            source: e,
        };
    }
    StoreError::sqlite(path, "committing a batch", e)
}

/// Whether closing `conn` checkpoints the write-ahead log (SQLite's default).
fn checkpoint_on_close(conn: &Connection, path: &Path, on: bool) -> Result<(), StoreError> {
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, !on)
        .map(|_| ())
        .map_err(|e| StoreError::sqlite(path, "configuring the database", e))
}

/// Checks an opened database and brings it to the current schema. Nothing is written
/// before the version and integrity checks pass.
fn prepare_connection(conn: &Connection, path: &Path) -> Result<(), StoreError> {
    let sql = |e| StoreError::sqlite(path, "checking the database", e);
    conn.busy_timeout(BUSY_TIMEOUT).map_err(sql)?;
    // EXCLUSIVE before the first read: the daemon is the database's only user (the state
    // directory's flock says so), so SQLite keeps its locks for the connection's life and
    // the WAL index in its own memory (no `-shm` file), instead of taking and dropping
    // POSIX locks on the index around every transaction.
    let _: String = conn
        .pragma_update_and_check(None, "locking_mode", "EXCLUSIVE", |r| r.get(0))
        .map_err(sql)?;
    // The first read of the header: a file that is not a database fails here (NOTADB,
    // classified as corrupt).
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(sql)?;
    let known = schema::current_version();
    if version > known {
        return Err(StoreError::NewerSchema {
            path: path.to_path_buf(),
            found: version,
            known,
        });
    }
    if version < 0 {
        return Err(StoreError::corrupt(
            path,
            format!("its schema version {version} is negative"),
        ));
    }
    quick_check(conn, path)?;
    if version == 0 {
        let tables: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get(0))
            .map_err(sql)?;
        if tables != 0 {
            return Err(StoreError::corrupt(
                path,
                "it has tables but no schema version, so it is not a hostdevd database",
            ));
        }
    } else {
        // Another program's database with a schema version of its own must be refused
        // before it is switched to WAL mode or migrated: every version has these tables
        // and the host generation.
        let ours: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_schema WHERE type = 'table'
                    AND name IN ('meta', 'records', 'requests')",
                [],
                |r| r.get(0),
            )
            .map_err(sql)?;
        let generation = ours == 3
            && conn
                .query_row(schema::SELECT_HOST_GENERATION, [], |_| Ok(()))
                .optional()
                .map_err(sql)?
                .is_some();
        if !generation {
            return Err(StoreError::corrupt(
                path,
                format!(
                    "it has schema version {version} but not the tables of a hostdevd database (meta with the host generation, records, requests), so it is not one"
                ),
            ));
        }
    }
    // Writes begin here, on a database that passed the checks.
    let sql = |e| StoreError::sqlite(path, "configuring the database", e);
    let mode: String = conn
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .map_err(sql)?;
    if !mode.eq_ignore_ascii_case("wal") {
        let mode: String = conn
            .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
            .map_err(sql)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(StoreError::Sqlite {
                path: path.to_path_buf(),
                op: "switching to WAL mode",
                source: rusqlite::Error::InvalidParameterName(format!(
                    "journal_mode stayed {mode}"
                )),
            });
        }
    }
    // FULL: in WAL mode the log is fsynced at every commit, so a commit that returned
    // survives a power cut (I4). NORMAL would only guarantee consistency.
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(sql)?;
    conn.pragma_update(None, "wal_autocheckpoint", WAL_CHECKPOINT_PAGES)
        .map_err(sql)?;
    // A small page cache: commits touch a handful of pages and `load` reads each one
    // once, so SQLite's default of 2 MiB would mostly hold what start-up read.
    conn.pragma_update(None, "cache_size", CACHE_KIB)
        .map_err(sql)?;
    // The schema is ours; nothing in it needs functions with side effects.
    conn.pragma_update(None, "trusted_schema", "OFF")
        .map_err(sql)?;
    if version < known {
        migrate(conn, path, version)?;
    }
    Ok(())
}

/// Runs `PRAGMA quick_check` and turns any complaint into a corruption error.
fn quick_check(conn: &Connection, path: &Path) -> Result<(), StoreError> {
    let sql = |e| StoreError::sqlite(path, "checking the database's integrity", e);
    let mut stmt = conn.prepare("PRAGMA quick_check").map_err(sql)?;
    let mut rows = stmt.query([]).map_err(sql)?;
    let mut complaints = Vec::new();
    while let Some(row) = rows.next().map_err(sql)? {
        let line: String = row.get(0).map_err(sql)?;
        if line != "ok" {
            complaints.push(line);
        }
    }
    if complaints.is_empty() {
        return Ok(());
    }
    let more = complaints.len().saturating_sub(MAX_CHECK_MESSAGES);
    complaints.truncate(MAX_CHECK_MESSAGES);
    let mut reason = format!("integrity check failed: {}", complaints.join("; "));
    if more > 0 {
        reason.push_str(&format!(" (and {more} more)"));
    }
    Err(StoreError::corrupt(path, reason))
}

/// Applies migrations `from..` and sets `user_version`, all in one transaction: a crash
/// or error leaves the database at its old version with its old schema.
fn migrate(conn: &Connection, path: &Path, from: i64) -> Result<(), StoreError> {
    let sql = |e| StoreError::sqlite(path, "migrating the schema", e);
    // `unchecked_transaction` only because the connection is borrowed shared here; it is
    // still one transaction that rolls back if dropped uncommitted.
    let tx = conn.unchecked_transaction().map_err(sql)?;
    apply_migrations(&tx, path, from)?;
    tx.commit().map_err(sql)
}

fn apply_migrations(conn: &Connection, path: &Path, from: i64) -> Result<(), StoreError> {
    let sql = |e| StoreError::sqlite(path, "migrating the schema", e);
    let start = usize::try_from(from).unwrap_or(usize::MAX);
    for migration in schema::MIGRATIONS.iter().skip(start) {
        conn.execute_batch(migration).map_err(sql)?;
    }
    // `user_version` is part of the transaction, so version and schema move together.
    conn.pragma_update(None, "user_version", schema::current_version())
        .map_err(sql)
}

/// The request log's index in memory, read from every entry's key (one row at a time:
/// the keys are not held).
fn index_requests(conn: &Connection, path: &Path) -> Result<RequestIndex, StoreError> {
    let sql = |e| StoreError::sqlite(path, "indexing the request log", e);
    let text = |e| StoreError::sqlite(path, "indexing the request log", rusqlite::Error::from(e));
    let mut stmt = conn
        .prepare_cached(schema::SELECT_REQUEST_KEYS)
        .map_err(sql)?;
    let mut rows = stmt.query([]).map_err(sql)?;
    let mut index = RequestIndex::empty();
    while let Some(row) = rows.next().map_err(sql)? {
        index.load(
            row.get(0).map_err(sql)?,
            row.get_ref(1).map_err(sql)?.as_str().map_err(text)?,
            row.get_ref(2).map_err(sql)?.as_str().map_err(text)?,
        );
    }
    index.seal();
    Ok(index)
}

/// Deletes the `excess` oldest request-log entries (the first logged). Returns the
/// sequence number of the oldest entry left (`next`, the next to be logged, when none
/// is).
fn prune_requests(
    conn: &Connection,
    path: &Path,
    excess: u64,
    next: i64,
) -> Result<i64, StoreError> {
    let sql = |e| StoreError::sqlite(path, "pruning the request log", e);
    let keep_from: Option<i64> = conn
        .prepare_cached(schema::SELECT_REQUEST_SEQ_AT)
        .map_err(sql)?
        .query_row([i64::try_from(excess).unwrap_or(i64::MAX)], |r| r.get(0))
        .optional()
        .map_err(sql)?;
    let keep_from = keep_from.unwrap_or(next);
    conn.prepare_cached(schema::DELETE_REQUESTS_BEFORE)
        .and_then(|mut stmt| stmt.execute([keep_from]))
        .map_err(sql)?;
    Ok(keep_from)
}

fn read_host_generation(conn: &Connection, path: &Path) -> Result<Generation, StoreError> {
    let sql = |e| StoreError::sqlite(path, "reading the host generation", e);
    let value: Option<rusqlite::types::Value> = conn
        .prepare_cached(schema::SELECT_HOST_GENERATION)
        .map_err(sql)?
        .query_row([], |r| r.get(0))
        .optional()
        .map_err(sql)?;
    match value {
        Some(rusqlite::types::Value::Integer(n)) => u64::try_from(n)
            .map(Generation)
            .map_err(|_| StoreError::corrupt(path, format!("the host generation {n} is negative"))),
        Some(other) => Err(StoreError::corrupt(
            path,
            format!("the host generation is not an integer ({other:?})"),
        )),
        None => Err(StoreError::corrupt(
            path,
            "the meta table has no host_generation row",
        )),
    }
}

/// The highest generation of any stored record (0 when there is none), from the
/// indexed column; `load` checks each against its record's JSON.
fn newest_record_generation(conn: &Connection, path: &Path) -> Result<Generation, StoreError> {
    let newest: Option<i64> = conn
        .prepare_cached(schema::SELECT_NEWEST_RECORD_GENERATION)
        .and_then(|mut stmt| stmt.query_row([], |r| r.get(0)))
        .map_err(|e| StoreError::sqlite(path, "reading the records' generations", e))?;
    match newest {
        None => Ok(Generation::default()),
        Some(n) => u64::try_from(n).map(Generation).map_err(|_| {
            StoreError::corrupt(path, format!("a record's generation {n} is negative"))
        }),
    }
}

/// The indexed columns of a `records` row, checked against the row's JSON.
struct RecordColumns {
    id: i64,
    address: String,
    generation: i64,
    present: bool,
    consumer: Option<String>,
}

fn decode_record(
    path: &Path,
    columns: &RecordColumns,
    json: &str,
) -> Result<DeviceRecord, StoreError> {
    let id = columns.id;
    let record: DeviceRecord = serde_json::from_str(json).map_err(|e| StoreError::Corrupt {
        path: path.to_path_buf(),
        reason: format!("record {id} does not decode: {e}"),
        source: None,
    })?;
    let consumer = record.claim.as_ref().map(|c| c.owner.consumer.to_string());
    let agrees = i64::try_from(record.id.0).ok() == Some(id)
        && record.address().to_string() == columns.address
        && i64::try_from(record.generation.0).ok() == Some(columns.generation)
        && record.present == columns.present
        && consumer == columns.consumer;
    if !agrees {
        return Err(StoreError::corrupt(
            path,
            format!(
                "record {id}: the columns (address {}, generation {}, present {}, consumer {:?}) \
                 disagree with its JSON",
                columns.address, columns.generation, columns.present, columns.consumer
            ),
        ));
    }
    Ok(record)
}

fn decode_request(
    path: &Path,
    consumer: &str,
    request_id: &str,
    outcome: &str,
    at: i64,
) -> Result<RequestEntry, StoreError> {
    let bad = |what: String| {
        StoreError::corrupt(
            path,
            format!("request {request_id:?} of {consumer:?}: {what}"),
        )
    };
    Ok(RequestEntry {
        consumer: ConsumerId::from_str(consumer).map_err(|e| bad(e.to_string()))?,
        request_id: RequestId::from_str(request_id).map_err(|e| bad(e.to_string()))?,
        outcome: serde_json::from_str::<Outcome>(outcome)
            .map_err(|e| bad(format!("the outcome does not decode: {e}")))?,
        at: u64::try_from(at).map_err(|_| bad(format!("its time {at} is negative")))?,
    })
}

/// SQLite integers are signed 64-bit; values past `i64::MAX` are refused, not wrapped,
/// since a wrapped generation would sort before every real one.
fn to_sql_int(path: &Path, what: &str, value: u64) -> Result<i64, StoreError> {
    i64::try_from(value).map_err(|_| StoreError::Encode {
        path: path.to_path_buf(),
        what: format!("{what} {value}"),
        reason: "it exceeds SQLite's 64-bit signed integer range".into(),
        source: None,
    })
}

/// `path` with `suffix` appended to its file name (`hostdevd.db` → `hostdevd.db-wal`).
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

#[cfg(test)]
impl Store {
    /// Makes the next commit fail at its COMMIT with the SQLite (extended) error `code`,
    /// rolled back: e.g. `SQLITE_IOERR_FSYNC`, an outcome the caller cannot know.
    pub(crate) fn fail_next_commit(&self, code: i32) {
        self.fail_commit.set(Some(code));
    }

    /// Makes every write fail as on a read-only file (SQLite's `query_only`), for tests of
    /// what a failed commit leaves behind elsewhere.
    pub(crate) fn refuse_writes(&self, refuse: bool) {
        self.conn
            .pragma_update(None, "query_only", refuse)
            .expect("query_only");
    }
}
