//! The store's SQL schema: the ordered list of migrations (`PRAGMA user_version` is the
//! number applied) and the statements the hot path prepares once and reuses.

/// Migrations in order; the schema version of a database is the number applied. Append
/// only: a released migration is never edited, since databases in the field already ran
/// it. Each one runs inside the single transaction that also bumps `user_version`.
pub(crate) const MIGRATIONS: &[&str] = &[
    // 1: the ledger. Columns hold what an operator queries with sqlite3 once the agent
    // has stopped (address, owner, generation; the agent holds the database
    // exclusively); `record` holds the full device record as JSON, the source of truth
    // that `load` decodes and checks against the columns.
    "CREATE TABLE meta (
        key   TEXT PRIMARY KEY NOT NULL,
        value ANY NOT NULL
    ) STRICT, WITHOUT ROWID;
    INSERT INTO meta (key, value) VALUES ('host_generation', 0);
    CREATE TABLE records (
        id         INTEGER PRIMARY KEY NOT NULL,
        address    TEXT NOT NULL,
        generation INTEGER NOT NULL,
        present    INTEGER NOT NULL CHECK (present IN (0, 1)),
        consumer   TEXT,
        record     TEXT NOT NULL
    ) STRICT;
    CREATE INDEX records_by_address ON records (address);
    CREATE INDEX records_by_consumer ON records (consumer) WHERE consumer IS NOT NULL;
    CREATE TABLE requests (
        consumer   TEXT NOT NULL,
        request_id TEXT NOT NULL,
        outcome    TEXT NOT NULL,
        at         INTEGER NOT NULL,
        PRIMARY KEY (consumer, request_id)
    ) STRICT, WITHOUT ROWID;
    CREATE INDEX requests_by_at ON requests (at);",
    // 2: no index on columns that every claim and release rewrites. Each one cost a page
    // in every commit's write-ahead log (a claim wrote five pages, now three), and
    // nothing in the agent searches by owner or by time: `load` reads every row once at
    // start and sorts the request log then. An operator's query by owner scans a table
    // of one row per device.
    "DROP INDEX records_by_consumer;
    DROP INDEX requests_by_at;",
    // 3: the request log in the order it was written, keyed by a sequence number, with no
    // key on (consumer, request_id): the store finds an entry through its index in
    // memory (`request_index`). Keyed by (consumer, request_id), each new entry landed
    // at a random place in a tree of thousands of pages, so each wrote a page of its
    // own, and splits rewrote more: under 64 clients, 68 of a commit's 75 log pages.
    // Appended, a commit's entries share a page or two. The old rows keep their order
    // (by time, then key).
    "CREATE TABLE request_log (
        seq        INTEGER PRIMARY KEY NOT NULL,
        consumer   TEXT NOT NULL,
        request_id TEXT NOT NULL,
        outcome    TEXT NOT NULL,
        at         INTEGER NOT NULL
    ) STRICT;
    INSERT INTO request_log (consumer, request_id, outcome, at)
        SELECT consumer, request_id, outcome, at FROM requests
        ORDER BY at, consumer, request_id;
    DROP TABLE requests;
    ALTER TABLE request_log RENAME TO requests;",
    // 4: no change to the tables. A request-log outcome may now be a binding's (PrepareVfio
    // with a request id) or a VF count change's (SetVfCount with one), which a build
    // before them cannot decode: with the version raised, such a build refuses the
    // database as written by a newer hostdevd, changing nothing, rather than calling an
    // entry corrupt (or opening it while no such entry exists yet, to fail on the first).
    "-- request-log outcomes: Bound and VfCountSet as well",
];

/// The schema version this build writes and understands.
pub(crate) fn current_version() -> i64 {
    // The list is a compile-time constant of a handful of entries.
    MIGRATIONS.len() as i64
}

/// The meta key holding the host generation; written only by `commit`, so I5 is
/// checked on every write of it.
pub(crate) const HOST_GENERATION_KEY: &str = "host_generation";

pub(crate) const SELECT_HOST_GENERATION: &str =
    "SELECT value FROM meta WHERE key = 'host_generation'";
pub(crate) const SELECT_NEWEST_RECORD_GENERATION: &str = "SELECT max(generation) FROM records";
pub(crate) const UPDATE_HOST_GENERATION: &str =
    "UPDATE meta SET value = ?1 WHERE key = 'host_generation'";
// The update leaves `address` out: naming an indexed column in SET rewrites its index
// entry even when the value is the same, one more page in every commit's WAL frames. A
// record id keeps its address for life; `FIX_RECORD_ADDRESS` covers any that did not.
pub(crate) const UPSERT_RECORD: &str = "INSERT INTO records
        (id, address, generation, present, consumer, record)
        VALUES (?1, ?2, ?3, ?4, ?5, ?6)
    ON CONFLICT (id) DO UPDATE SET
        generation = excluded.generation,
        present = excluded.present,
        consumer = excluded.consumer,
        record = excluded.record";
/// Writes nothing (no page touched) when the stored address is already right.
pub(crate) const FIX_RECORD_ADDRESS: &str =
    "UPDATE records SET address = ?2 WHERE id = ?1 AND address IS NOT ?2";
pub(crate) const DELETE_RECORD: &str = "DELETE FROM records WHERE id = ?1";
/// A new entry goes after every other: `seq` is the store's next sequence number.
pub(crate) const INSERT_REQUEST: &str =
    "INSERT INTO requests (seq, consumer, request_id, outcome, at) VALUES (?1, ?2, ?3, ?4, ?5)";
/// One entry by its sequence number (the index in memory names the candidates).
pub(crate) const SELECT_REQUEST_AT: &str =
    "SELECT consumer, request_id, outcome, at FROM requests WHERE seq = ?1";
/// What the index in memory is built from at open.
pub(crate) const SELECT_REQUEST_KEYS: &str = "SELECT seq, consumer, request_id FROM requests";
/// The sequence number of the entry with `?1` older ones (none past the newest).
pub(crate) const SELECT_REQUEST_SEQ_AT: &str =
    "SELECT seq FROM requests ORDER BY seq LIMIT 1 OFFSET ?1";
/// Deletes the entries before `?1`, the oldest: a range at the tree's left edge.
pub(crate) const DELETE_REQUESTS_BEFORE: &str = "DELETE FROM requests WHERE seq < ?1";
pub(crate) const SELECT_RECORDS: &str =
    "SELECT id, address, generation, present, consumer, record FROM records ORDER BY id";
/// The newest `?1` entries (all of them for -1), newest first.
pub(crate) const SELECT_NEWEST_REQUESTS: &str =
    "SELECT consumer, request_id, outcome, at FROM requests ORDER BY seq DESC LIMIT ?1";
pub(crate) const SELECT_META: &str = "SELECT CAST(value AS TEXT) FROM meta WHERE key = ?1";
pub(crate) const UPSERT_META: &str = "INSERT INTO meta (key, value) VALUES (?1, ?2)
    ON CONFLICT (key) DO UPDATE SET value = excluded.value";
