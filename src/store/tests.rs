//! Unit tests of the store: every kind of change survives a reopen, batches are atomic,
//! generations never go backwards, and damaged or foreign databases are refused untouched.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use rusqlite::Connection;
use tempfile::TempDir;

use super::*;
use crate::ledger::model::{Claim, DeviceFacts, DomainRef, Owner, RecordId};
use crate::pci::{DeviceId, OwnerLabel, PciAddress, PhysNet, VendorId};

fn address(function: u8) -> PciAddress {
    PciAddress::new(0, 0x3b, 2, function).expect("valid address")
}

fn consumer(n: u8) -> ConsumerId {
    ConsumerId(uuid::Uuid::from_bytes([n; 16]))
}

fn request_id(s: &str) -> RequestId {
    s.parse().expect("valid request id")
}

fn facts(function: u8) -> DeviceFacts {
    DeviceFacts {
        address: address(function),
        vendor_id: VendorId(0x8086),
        device_id: DeviceId(0x10ed),
        driver: Some("vfio-pci".into()),
        iommu_group: Some(40 + u32::from(function)),
        numa_node: Some(1),
        physfn: PciAddress::new(0, 0x3b, 0, 0),
        is_pf: false,
        physnets: vec!["physnet1".parse::<PhysNet>().expect("valid physnet")],
        managed: true,
        instance: None,
    }
}

fn record(id: u64, function: u8, generation: u64, owner: Option<u8>) -> DeviceRecord {
    DeviceRecord {
        id: RecordId(id),
        facts: facts(function),
        generation: Generation(generation),
        present: true,
        claim: owner.map(|n| Claim {
            owner: Owner {
                consumer: consumer(n),
                label: "vm-label".parse::<OwnerLabel>().expect("valid label"),
            },
            request_id: request_id(&format!("claim-{n}-{generation}")),
            claimed_at: 1_700_000_000 + generation,
            since: None,
            vfio: None,
        }),
        attached: None,
    }
}

fn entry(n: u8, id: &str, rec: &DeviceRecord, at: u64) -> RequestEntry {
    RequestEntry {
        consumer: consumer(n),
        request_id: request_id(id),
        outcome: Outcome::Claimed {
            address: rec.address(),
            record: rec.id,
            generation: rec.generation,
        },
        at,
    }
}

fn change(prev: u64, host: u64) -> ChangeSet {
    ChangeSet {
        prev_host_generation: Generation(prev),
        host_generation: Generation(host),
        ..ChangeSet::default()
    }
}

/// What the store should hold after a sequence of commits: the same rules, applied to
/// plain collections.
#[derive(Default)]
struct Model {
    host_generation: Generation,
    records: BTreeMap<RecordId, DeviceRecord>,
    /// In the order logged; an entry logged again replaces the one before.
    requests: Vec<RequestEntry>,
}

impl Model {
    fn apply(&mut self, batch: &[ChangeSet]) {
        for cs in batch {
            for r in &cs.upserts {
                self.records.insert(r.id, r.clone());
            }
            for id in &cs.removals {
                self.records.remove(id);
            }
            for e in &cs.requests {
                self.requests
                    .retain(|old| (old.consumer, &old.request_id) != (e.consumer, &e.request_id));
                self.requests.push(e.clone());
            }
            self.host_generation = cs.host_generation;
        }
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            host_generation: self.host_generation,
            records: self.records.clone(),
            requests: self.requests.clone(),
        }
    }
}

fn reopen(dir: &Path) -> Store {
    Store::open(dir).expect("reopen store")
}

/// Commits the batch, mirrors it in the model, and checks a fresh open loads the model.
fn commit_and_check(store: Store, model: &mut Model, batch: &[ChangeSet]) -> Store {
    let mut store = store;
    store.commit(batch).expect("commit");
    model.apply(batch);
    assert_eq!(store.load().expect("load"), model.snapshot(), "same store");
    let dir = store.state_dir().to_path_buf();
    drop(store);
    let store = reopen(&dir);
    assert_eq!(
        store.load().expect("load"),
        model.snapshot(),
        "after reopen"
    );
    store
}

#[test]
fn fresh_store_is_empty_versioned_and_private() {
    let tmp = TempDir::new().expect("tempdir");
    let dir = tmp.path().join("state").join("hostdevd");
    let store = Store::open(&dir).expect("open");
    assert_eq!(store.load().expect("load"), Snapshot::default());
    assert_eq!(store.path(), dir.join(DB_FILE));
    let mode = fs::metadata(&dir).expect("dir").permissions().mode() & 0o777;
    assert_eq!(mode & !0o750, 0, "state dir mode {mode:o} is at most 0750");
    drop(store);
    let conn = Connection::open(dir.join(DB_FILE)).expect("sqlite");
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .expect("user_version");
    assert_eq!(version, schema_version());
    let mode: String = conn
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .expect("journal_mode");
    assert_eq!(mode, "wal");
    assert!(
        !dir.join(NEW_DB_FILE).exists(),
        "temporary database renamed"
    );
}

#[test]
fn the_live_connection_syncs_every_commit_and_keeps_its_log_short() {
    let tmp = TempDir::new().expect("tempdir");
    let store = Store::open(tmp.path()).expect("open");
    let get = |name: &str| -> rusqlite::types::Value {
        store
            .conn
            .pragma_query_value(None, name, |r| r.get(0))
            .expect(name)
    };
    // 2 is FULL: the log is fsynced at every commit (I4).
    assert_eq!(get("synchronous"), rusqlite::types::Value::Integer(2));
    assert_eq!(
        get("wal_autocheckpoint"),
        rusqlite::types::Value::Integer(WAL_CHECKPOINT_PAGES)
    );
    assert_eq!(
        get("locking_mode"),
        rusqlite::types::Value::Text("exclusive".into())
    );
}

#[test]
fn every_kind_of_change_survives_reopen() {
    let tmp = TempDir::new().expect("tempdir");
    let mut model = Model::default();
    let store = Store::open(tmp.path()).expect("open");

    // Insert three records.
    let mut cs = change(0, 3);
    cs.upserts = vec![
        record(1, 0, 1, None),
        record(2, 1, 2, None),
        record(3, 2, 3, None),
    ];
    let store = commit_and_check(store, &mut model, &[cs]);

    // Claim one: an update with an owner and a request entry.
    let claimed = record(2, 1, 4, Some(7));
    let mut cs = change(3, 4);
    cs.upserts = vec![claimed.clone()];
    cs.requests = vec![entry(7, "req-a", &claimed, 100)];
    let store = commit_and_check(store, &mut model, &[cs]);

    // The device vanished and was marked lost; it is attached to a domain meanwhile.
    let mut lost = claimed.clone();
    lost.present = false;
    lost.generation = Generation(5);
    lost.attached = Some(DomainRef {
        uuid: uuid::Uuid::from_bytes([7; 16]),
        name: "instance-0007".into(),
        running: true,
    });
    let mut cs = change(4, 5);
    cs.upserts = vec![lost];
    let store = commit_and_check(store, &mut model, &[cs]);

    // Remove a record.
    let mut cs = change(5, 6);
    cs.removals = vec![RecordId(1)];
    let store = commit_and_check(store, &mut model, &[cs]);

    // More request entries, one of them a binding's.
    let mut cs = change(6, 7);
    let r3 = record(3, 2, 7, Some(8));
    cs.upserts = vec![r3.clone()];
    let bound = RequestEntry {
        outcome: Outcome::Bound {
            address: r3.address(),
            record: r3.id,
            generation: r3.generation,
        },
        ..entry(8, "req-c", &r3, 99)
    };
    cs.requests = vec![entry(8, "req-b", &r3, 101), bound.clone()];
    let store = commit_and_check(store, &mut model, &[cs]);

    // A release: owner gone, consumer column back to NULL.
    let mut cs = change(7, 8);
    cs.upserts = vec![record(3, 2, 8, None)];
    let store = commit_and_check(store, &mut model, &[cs]);

    let snapshot = store.load().expect("load");
    assert_eq!(snapshot.host_generation, Generation(8));
    assert_eq!(snapshot.records.len(), 2);
    assert_eq!(snapshot.requests.len(), 3);
    // Requests come back in the order logged, whatever their times.
    let order: Vec<&str> = snapshot
        .requests
        .iter()
        .map(|e| e.request_id.as_str())
        .collect();
    assert_eq!(order, ["req-a", "req-b", "req-c"]);
    // Each is found by its key; another consumer's same request id is not.
    let found = store
        .request(consumer(8), &request_id("req-b"))
        .expect("lookup");
    assert_eq!(found.as_ref(), snapshot.requests.get(1));
    assert_eq!(
        store
            .request(consumer(8), &request_id("req-c"))
            .expect("lookup"),
        Some(bound)
    );
    assert_eq!(
        store
            .request(consumer(7), &request_id("req-b"))
            .expect("lookup"),
        None
    );
    // The newest only, still oldest first.
    let newest = store.load_recent(2).expect("load");
    assert_eq!(newest.requests, snapshot.requests[1..]);
    assert_eq!(newest.records, snapshot.records);
}

/// The request log on disk is pruned by the store, oldest first (the first logged, whatever
/// their times say), once it holds more than its limit, in a transaction of its own; the
/// count survives a reopen.
#[test]
fn request_log_is_pruned_oldest_first_on_disk() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    store.set_request_log_limit(10);
    let rec = record(1, 0, 1, Some(1));
    let mut cs = change(0, 1);
    cs.upserts = vec![rec.clone()];
    store.commit(&[cs]).expect("commit");
    for i in 0..10u64 {
        let mut cs = change(i + 1, i + 1);
        // Times out of order with the commits (a clock set back): the prune goes by the
        // order logged.
        cs.requests = vec![entry(1, &format!("r{i}"), &rec, 1000 - i)];
        store.commit(&[cs]).expect("commit");
    }
    assert!(
        !store.prune_request_log().expect("prune"),
        "at the limit: nothing to prune"
    );
    assert_eq!(store.request_log_len(), 10);
    let mut cs = change(11, 11);
    cs.requests = vec![entry(1, "r10", &rec, 2000)];
    store.commit(&[cs]).expect("commit");
    assert_eq!(store.request_log_len(), 11, "a commit never prunes");
    assert!(store.prune_request_log().expect("prune"));
    // Past it: the oldest one over the limit and a tenth of the limit more (2 in all).
    assert_eq!(store.request_log_len(), 9);
    let kept: Vec<String> = store
        .load()
        .expect("load")
        .requests
        .iter()
        .map(|e| e.request_id.as_str().to_owned())
        .collect();
    assert_eq!(
        kept,
        ["r2", "r3", "r4", "r5", "r6", "r7", "r8", "r9", "r10"]
    );
    for gone in ["r0", "r1"] {
        assert!(store
            .request(consumer(1), &request_id(gone))
            .expect("lookup")
            .is_none());
    }
    for kept in ["r2", "r9", "r10"] {
        assert!(store
            .request(consumer(1), &request_id(kept))
            .expect("lookup")
            .is_some());
    }
    drop(store);
    assert_eq!(reopen(tmp.path()).request_log_len(), 9);
}

/// Puts the request log back as versions 1 and 2 shipped it, keyed by consumer and
/// request id, with the entries it holds.
fn keyed_request_log(conn: &Connection) {
    conn.execute_batch(
        "CREATE TABLE keyed (
             consumer   TEXT NOT NULL,
             request_id TEXT NOT NULL,
             outcome    TEXT NOT NULL,
             at         INTEGER NOT NULL,
             PRIMARY KEY (consumer, request_id)
         ) STRICT, WITHOUT ROWID;
         INSERT INTO keyed SELECT consumer, request_id, outcome, at FROM requests;
         DROP TABLE requests;
         ALTER TABLE keyed RENAME TO requests;",
    )
    .expect("the keyed request log");
}

/// A database written by the first schema (with the owner and time indexes) opens,
/// migrates to the current schema in place and loads the same ledger.
#[test]
fn a_version_1_database_migrates_and_keeps_its_ledger() {
    let tmp = TempDir::new().expect("tempdir");
    let mut model = Model::default();
    let store = Store::open(tmp.path()).expect("open");
    let claimed = record(1, 0, 2, Some(4));
    let mut cs = change(0, 2);
    cs.upserts = vec![claimed.clone(), record(2, 1, 1, None)];
    cs.requests = vec![entry(4, "req-a", &claimed, 100)];
    let store = commit_and_check(store, &mut model, &[cs]);
    drop(store);
    {
        // Back to version 1 as it shipped: its indexes, its version number.
        let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
        keyed_request_log(&conn);
        conn.execute_batch(
            "CREATE INDEX records_by_consumer ON records (consumer) WHERE consumer IS NOT NULL;
             CREATE INDEX requests_by_at ON requests (at);
             PRAGMA user_version = 1;",
        )
        .expect("downgrade");
    }
    let store = reopen(tmp.path());
    assert_eq!(store.load().expect("load"), model.snapshot());
    drop(store);
    let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .expect("user_version");
    assert_eq!(version, schema_version());
    let indexes: Vec<String> = conn
        .prepare(
            "SELECT name FROM sqlite_schema WHERE type = 'index' AND sql IS NOT NULL ORDER BY name",
        )
        .expect("prepare")
        .query_map([], |r| r.get(0))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("names");
    assert_eq!(indexes, vec!["records_by_address".to_string()]);
}

/// A version 2 database's request log (keyed by consumer and request id) moves into the
/// log in order: by time, then key, as version 2 loaded it. Every entry is found by key
/// afterwards, and new entries go after them.
#[test]
fn a_version_2_request_log_migrates_in_order() {
    let tmp = TempDir::new().expect("tempdir");
    drop(Store::open(tmp.path()).expect("open"));
    let rec = record(1, 0, 1, Some(1));
    let outcome = serde_json::to_string(&entry(1, "x", &rec, 0).outcome).expect("json");
    {
        let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
        keyed_request_log(&conn);
        conn.pragma_update(None, "user_version", 2)
            .expect("downgrade");
        for (c, r, at) in [(2, "b", 50), (1, "z", 10), (1, "a", 50), (2, "a", 40)] {
            conn.execute(
                "INSERT INTO requests VALUES (?1, ?2, ?3, ?4)",
                rusqlite::params![consumer(c).to_string(), r, outcome, at],
            )
            .expect("insert");
        }
    }
    let mut store = reopen(tmp.path());
    let order = |store: &Store| -> Vec<(ConsumerId, String)> {
        store
            .load()
            .expect("load")
            .requests
            .iter()
            .map(|e| (e.consumer, e.request_id.as_str().to_owned()))
            .collect()
    };
    let migrated = vec![
        (consumer(1), "z".to_owned()),
        (consumer(2), "a".to_owned()),
        (consumer(1), "a".to_owned()),
        (consumer(2), "b".to_owned()),
    ];
    assert_eq!(order(&store), migrated);
    for (c, r) in &migrated {
        assert!(store.request(*c, &request_id(r)).expect("lookup").is_some());
    }
    assert!(store
        .request(consumer(1), &request_id("b"))
        .expect("lookup")
        .is_none());
    let mut cs = change(1, 1);
    cs.requests = vec![entry(1, "new", &rec, 5)];
    store.commit(&[cs]).expect("commit");
    let mut expected = migrated;
    expected.push((consumer(1), "new".to_owned()));
    assert_eq!(order(&store), expected);
    drop(store);
    assert_eq!(order(&reopen(tmp.path())), expected);
}

/// Every entry of a log longer than the index's short list (so its merges ran) is found
/// by key, before and after a reopen rebuilds the index; ids never logged are not, nor is
/// a logged id under another consumer.
#[test]
fn every_logged_request_is_found_by_key() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    let rec = record(1, 0, 1, Some(1));
    for batch in 0..50u64 {
        let mut cs = change(batch, batch);
        cs.requests = (0..100)
            .map(|i| batch * 100 + i)
            .map(|n| entry(1 + (n % 3) as u8, &format!("r{n}"), &rec, batch))
            .collect();
        store.commit(&[cs]).expect("commit");
    }
    assert_eq!(store.request_log_len(), 5000);
    let mut store = Some(store);
    for _ in 0..2 {
        let store = match store.take() {
            Some(s) => s,
            None => reopen(tmp.path()),
        };
        assert_eq!(store.request_log_len(), 5000);
        for n in (0..5000u64).step_by(7) {
            let c = consumer(1 + (n % 3) as u8);
            let found = store
                .request(c, &request_id(&format!("r{n}")))
                .expect("lookup")
                .expect("logged");
            assert_eq!(
                (found.consumer, found.request_id.as_str()),
                (c, format!("r{n}").as_str())
            );
            let other = consumer(1 + ((n + 1) % 3) as u8);
            assert!(store
                .request(other, &request_id(&format!("r{n}")))
                .expect("lookup")
                .is_none());
        }
        assert!(store
            .request(consumer(1), &request_id("r5000"))
            .expect("lookup")
            .is_none());
    }
}

/// An acting audit's per-device entries are found by the audit id alone, before and
/// after a reopen rebuilds the index, among other entries (a client's id of the same
/// form under another audit id, ids that only look like one); nothing for an unknown id.
#[test]
fn an_audits_frees_are_found_by_its_id() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    let rec = record(1, 0, 1, Some(1));
    let audit = request_id("audit-9");
    let mut cs = change(0, 1);
    cs.requests = vec![
        entry(1, "claim-1", &rec, 1),
        entry(
            1,
            audit.per_device(address(1)).expect("id").as_str(),
            &rec,
            1,
        ),
        entry(2, "audit-90@0000:3b:02.1", &rec, 1),
        entry(2, "audit-9@3b:02.1", &rec, 1),
    ];
    store.commit(&[cs]).expect("commit");
    let mut cs = change(1, 2);
    cs.requests = vec![entry(
        3,
        audit.per_device(address(4)).expect("id").as_str(),
        &rec,
        2,
    )];
    store.commit(&[cs]).expect("commit");
    let mut store = Some(store);
    for _ in 0..2 {
        let store = match store.take() {
            Some(s) => s,
            None => reopen(tmp.path()),
        };
        let found: Vec<(ConsumerId, String)> = store
            .audit_entries(&audit)
            .expect("lookup")
            .into_iter()
            .map(|e| (e.consumer, e.request_id.as_str().to_string()))
            .collect();
        assert_eq!(
            found,
            vec![
                (consumer(1), "audit-9@0000:3b:02.1".to_string()),
                (consumer(3), "audit-9@0000:3b:02.4".to_string()),
            ]
        );
        assert!(store
            .audit_entries(&request_id("audit-8"))
            .expect("lookup")
            .is_empty());
    }
}

/// The ledger never moves a record id to another address, but the store does not rely
/// on it: the address column follows the record, so a reopen never sees a disagreement.
#[test]
fn a_record_that_changes_address_is_stored_with_the_new_one() {
    let tmp = TempDir::new().expect("tempdir");
    let mut model = Model::default();
    let store = Store::open(tmp.path()).expect("open");
    let mut cs = change(0, 1);
    cs.upserts = vec![record(1, 0, 1, None)];
    let store = commit_and_check(store, &mut model, &[cs]);
    let mut cs = change(1, 2);
    cs.upserts = vec![record(1, 5, 2, Some(3))];
    let store = commit_and_check(store, &mut model, &[cs]);
    drop(store);
    let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
    let column: String = conn
        .query_row("SELECT address FROM records WHERE id = 1", [], |r| r.get(0))
        .expect("row");
    assert_eq!(column, address(5).to_string());
}

#[test]
fn a_batch_is_one_transaction() {
    let tmp = TempDir::new().expect("tempdir");
    let mut model = Model::default();
    let mut store = Store::open(tmp.path()).expect("open");

    // Several change sets in one batch all land, in order: the later upsert wins and a
    // record inserted then removed within the batch is gone.
    let mut a = change(0, 1);
    a.upserts = vec![record(1, 0, 1, None)];
    let mut b = change(1, 2);
    b.upserts = vec![record(2, 1, 2, Some(1)), record(3, 2, 2, None)];
    let mut c = change(2, 3);
    c.upserts = vec![record(1, 0, 3, Some(2))];
    c.removals = vec![RecordId(3)];
    let batch = [a, b, c];
    store = commit_and_check(store, &mut model, &batch);

    // A batch whose last change set cannot be encoded (an id past SQLite's range) fails
    // after the first ones were applied inside the transaction: none of it may remain.
    let mut d = change(3, 4);
    d.upserts = vec![record(2, 1, 4, None)];
    let mut e = change(4, 5);
    e.upserts = vec![record(u64::MAX, 3, 5, None)];
    let err = store.commit(&[d, e]).expect_err("unencodable id");
    assert!(matches!(err, StoreError::Encode { .. }), "{err}");
    assert_eq!(store.load().expect("load"), model.snapshot());
    drop(store);
    assert_eq!(
        reopen(tmp.path()).load().expect("load"),
        model.snapshot(),
        "nothing of the failed batch is on disk"
    );
}

/// `err` refuses a batch at generation `proposed` below the stored `stored`.
fn assert_backwards(err: &StoreError, stored: u64, proposed: u64) {
    match err {
        StoreError::BackwardsGeneration {
            stored: s,
            proposed: p,
            ..
        } => assert_eq!((*s, *p), (Generation(stored), Generation(proposed))),
        other => panic!("expected BackwardsGeneration, got {other}"),
    }
}

#[test]
fn host_generation_never_goes_backwards() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    let mut cs = change(0, 5);
    cs.upserts = vec![record(5, 0, 5, None)];
    store.commit(&[cs]).expect("commit");

    let mut back = change(5, 3);
    back.upserts = vec![record(6, 1, 3, None)];
    let err = store.commit(&[back]).expect_err("backwards");
    assert_backwards(&err, 5, 3);
    assert!(err.to_string().contains(DB_FILE), "{err}");

    // Backwards within a batch, even if the batch ends higher.
    let mut up = change(5, 9);
    up.upserts = vec![record(7, 2, 9, None)];
    let mut down = change(9, 4);
    down.upserts = vec![record(8, 3, 4, None)];
    let mut last = change(4, 10);
    last.upserts = vec![record(9, 4, 10, None)];
    let err = store.commit(&[up, down, last]).expect_err("dip in batch");
    assert!(
        matches!(err, StoreError::BackwardsGeneration { .. }),
        "{err}"
    );

    drop(store);
    let store = reopen(tmp.path());
    let snapshot = store.load().expect("load");
    assert_eq!(snapshot.host_generation, Generation(5));
    assert_eq!(
        snapshot.records.keys().copied().collect::<Vec<_>>(),
        [RecordId(5)]
    );
}

/// A batch that fails halfway through its statements (a record id SQLite cannot hold,
/// after a record it wrote) leaves nothing of itself, in this connection or on disk, and
/// the next batch commits on the same connection.
#[test]
fn a_batch_that_fails_midway_leaves_nothing_and_the_next_commits() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    let mut first = change(0, 1);
    first.upserts = vec![record(1, 0, 1, None)];
    store.commit(&[first]).expect("commit");

    let mut half = change(1, 3);
    half.upserts = vec![record(2, 1, 2, None), record(u64::MAX, 2, 3, None)];
    let err = store
        .commit(&[half])
        .expect_err("an id beyond SQLite's integers");
    assert!(err.to_string().contains("record id"), "{err}");
    let ids = |s: &Store| {
        let snap = s.load().expect("load");
        (
            snap.records.keys().copied().collect::<Vec<_>>(),
            snap.host_generation,
        )
    };
    assert_eq!(
        ids(&store),
        (vec![RecordId(1)], Generation(1)),
        "nothing of the failed batch"
    );

    let mut next = change(1, 4);
    next.upserts = vec![record(3, 3, 4, None)];
    store.commit(&[next]).expect("the next batch commits");
    assert_eq!(ids(&store), (vec![RecordId(1), RecordId(3)], Generation(4)));
    drop(store);
    assert_eq!(
        ids(&reopen(tmp.path())),
        (vec![RecordId(1), RecordId(3)], Generation(4)),
        "and so does the disk"
    );
}

/// The host generation as the meta row holds it, read with a connection of its own
/// once the store is closed.
fn stored_row(dir: &Path) -> i64 {
    Connection::open(dir.join(DB_FILE))
        .and_then(|c| {
            c.query_row(
                "SELECT value FROM meta WHERE key = 'host_generation'",
                [],
                |r| r.get(0),
            )
        })
        .expect("read the meta row")
}

#[test]
fn a_batch_whose_record_carries_its_generation_leaves_the_row_alone() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    // A claim: the record takes the batch's new host generation.
    let mut claim = change(0, 5);
    claim.upserts = vec![record(5, 0, 5, Some(1))];
    store.commit(&[claim]).expect("commit");
    assert_eq!(store.host_generation().expect("gen"), Generation(5));
    drop(store);
    assert_eq!(stored_row(tmp.path()), 0, "the row was not rewritten");

    // Still durable: a reopen takes the record's generation, and refuses to go back.
    let mut store = reopen(tmp.path());
    assert_eq!(store.host_generation().expect("gen"), Generation(5));
    assert_eq!(
        store.meta_get(HOST_GENERATION_KEY).expect("get").as_deref(),
        Some("5")
    );
    assert_eq!(store.load().expect("load").host_generation, Generation(5));
    let mut back = change(5, 4);
    back.upserts = vec![record(6, 1, 4, None)];
    assert_backwards(&store.commit(&[back]).expect_err("backwards"), 5, 4);
}

#[test]
fn a_removal_or_a_generation_no_record_carries_writes_the_row() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    let mut add = change(0, 5);
    add.upserts = vec![record(5, 0, 5, None)];
    store.commit(&[add]).expect("add");
    // The removal's own generation lives on in no record: only the row keeps it.
    let mut gone = change(5, 6);
    gone.removals = vec![RecordId(5)];
    store.commit(&[gone]).expect("remove");
    drop(store);
    assert_eq!(stored_row(tmp.path()), 6);
    let mut store = reopen(tmp.path());
    let snapshot = store.load().expect("load");
    assert_eq!(snapshot.host_generation, Generation(6));
    assert!(snapshot.records.is_empty());

    // A batch that ends past every record it writes.
    let mut past = change(6, 9);
    past.upserts = vec![record(7, 1, 7, None)];
    store.commit(&[past]).expect("past");
    drop(store);
    assert_eq!(stored_row(tmp.path()), 9);
    assert_eq!(
        reopen(tmp.path()).host_generation().expect("gen"),
        Generation(9)
    );
}

#[test]
fn empty_batches_write_nothing() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    store.commit::<ChangeSet>(&[]).expect("empty batch");
    store
        .commit(&[change(0, 0), change(0, 0)])
        .expect("empty change sets");
    assert_eq!(store.load().expect("load"), Snapshot::default());
    // A bare generation bump is a change and is recorded.
    store.commit(&[change(0, 2)]).expect("bump");
    assert_eq!(store.host_generation().expect("gen"), Generation(2));
}

#[test]
fn second_open_of_the_same_dir_is_locked() {
    let tmp = TempDir::new().expect("tempdir");
    let first = Store::open(tmp.path()).expect("open");
    let err = Store::open(tmp.path()).expect_err("second open");
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(&tmp.path().display().to_string()), "{text}");
    assert!(
        text.contains(&format!("pid {}", std::process::id())),
        "names the holder: {text}"
    );
    drop(first);
    Store::open(tmp.path()).expect("open after the first closed");
}

/// Creates a store with some content and closes it, returning the database's bytes.
fn populated(dir: &Path) -> Vec<u8> {
    let mut store = Store::open(dir).expect("open");
    let mut cs = change(0, 40);
    cs.upserts = (0..40u8)
        .map(|i| record(u64::from(i) + 1, i % 8, 40, Some(i)))
        .collect();
    store.commit(&[cs]).expect("commit");
    drop(store);
    assert!(
        !dir.join("hostdevd.db-wal").exists(),
        "clean close checkpoints"
    );
    fs::read(dir.join(DB_FILE)).expect("db bytes")
}

fn assert_refused_untouched(dir: &Path, expect: fn(&StoreError) -> bool) -> StoreError {
    let db = dir.join(DB_FILE);
    let before = fs::read(&db).expect("db bytes");
    let err = Store::open(dir).expect_err("open must fail");
    assert!(expect(&err), "unexpected error: {err}");
    assert!(
        err.to_string().contains(&db.display().to_string()),
        "names the file: {err}"
    );
    assert_eq!(fs::read(&db).expect("db bytes"), before, "file unchanged");
    // And again: a second attempt is refused the same way, still without a write.
    let again = Store::open(dir).expect_err("open must fail again");
    assert!(expect(&again), "unexpected error: {again}");
    assert_eq!(fs::read(&db).expect("db bytes"), before, "file unchanged");
    err
}

#[test]
fn garbage_over_the_whole_file_is_corrupt() {
    let tmp = TempDir::new().expect("tempdir");
    let bytes = populated(tmp.path());
    let garbage: Vec<u8> = (0..bytes.len()).map(|i| (i * 7 + 13) as u8).collect();
    fs::write(tmp.path().join(DB_FILE), garbage).expect("write garbage");
    assert_refused_untouched(tmp.path(), StoreError::is_corrupt);
}

#[test]
fn garbage_over_a_data_page_is_corrupt() {
    let tmp = TempDir::new().expect("tempdir");
    let mut bytes = populated(tmp.path());
    assert!(bytes.len() > 3 * 4096, "several pages");
    for b in &mut bytes[4096..2 * 4096] {
        *b = 0xa5;
    }
    fs::write(tmp.path().join(DB_FILE), bytes).expect("write garbage");
    assert_refused_untouched(tmp.path(), StoreError::is_corrupt);
}

#[test]
fn truncated_file_is_corrupt() {
    for keep in [0usize, 50, 4096] {
        let tmp = TempDir::new().expect("tempdir");
        let bytes = populated(tmp.path());
        fs::write(tmp.path().join(DB_FILE), &bytes[..keep]).expect("truncate");
        let err = assert_refused_untouched(tmp.path(), StoreError::is_corrupt);
        assert!(err.to_string().contains("corrupt"), "{keep}: {err}");
    }
}

#[test]
fn newer_schema_is_refused_untouched() {
    let tmp = TempDir::new().expect("tempdir");
    populated(tmp.path());
    let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
    conn.pragma_update(None, "user_version", 999)
        .expect("set user_version");
    drop(conn);
    let err = assert_refused_untouched(tmp.path(), |e| {
        matches!(e, StoreError::NewerSchema { found: 999, .. })
    });
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "was written by a newer hostdevd (schema 999, this build knows up to {})",
            schema_version()
        )),
        "{text}"
    );
}

/// A database refused with a live write-ahead log (a copy taken while its daemon ran)
/// keeps the log: closing the connection that checked it copies nothing in.
#[test]
fn a_refused_database_keeps_its_write_ahead_log() {
    let tmp = TempDir::new().expect("tempdir");
    let live = tmp.path().join("live");
    let copy = tmp.path().join("copy");
    let mut store = Store::open(&live).expect("open");
    let mut cs = change(0, 40);
    cs.upserts = (0..8u8)
        .map(|i| record(u64::from(i) + 1, i, 40, Some(i)))
        .collect();
    store.commit(&[cs]).expect("commit");
    fs::create_dir(&copy).expect("mkdir");
    for name in [DB_FILE, "hostdevd.db-wal"] {
        fs::copy(live.join(name), copy.join(name)).expect("copy while open");
    }
    drop(store);
    // A newer build's schema version, written into the log only.
    let conn = Connection::open(copy.join(DB_FILE)).expect("sqlite");
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
        true,
    )
    .expect("no checkpoint on close");
    conn.pragma_update(None, "user_version", 999)
        .expect("set user_version");
    drop(conn);
    let wal = copy.join("hostdevd.db-wal");
    let log = fs::read(&wal).expect("the log is there");
    assert!(!log.is_empty(), "the log holds the commits");
    let err = assert_refused_untouched(&copy, |e| {
        matches!(e, StoreError::NewerSchema { found: 999, .. })
    });
    assert!(err.to_string().contains("newer hostdevd"), "{err}");
    assert_eq!(
        fs::read(&wal).expect("the log is still there"),
        log,
        "log unchanged"
    );
}

#[test]
fn foreign_database_is_refused() {
    let tmp = TempDir::new().expect("tempdir");
    let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
    conn.execute_batch("CREATE TABLE other (x); INSERT INTO other VALUES (1);")
        .expect("foreign db");
    drop(conn);
    let err = assert_refused_untouched(tmp.path(), StoreError::is_corrupt);
    assert!(err.to_string().contains("not a hostdevd database"), "{err}");
}

/// Another program's database with a schema version of its own is refused before
/// anything is written to it (an earlier version switched it to WAL mode and tried to
/// migrate it, and failed on a missing table).
#[test]
fn a_foreign_database_with_a_schema_version_is_refused_untouched() {
    for (version, tables) in [
        (1, "CREATE TABLE other (x); INSERT INTO other VALUES (1);"),
        (2, "CREATE TABLE meta (key TEXT PRIMARY KEY, value ANY); CREATE TABLE records (id); CREATE TABLE requests (x);"),
        (3, ""),
    ] {
        let tmp = TempDir::new().expect("tempdir");
        let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
        conn.execute_batch(&format!("{tables} PRAGMA user_version = {version};"))
            .expect("foreign db");
        drop(conn);
        let err = assert_refused_untouched(tmp.path(), StoreError::is_corrupt);
        assert!(
            err.to_string().contains("not the tables of a hostdevd database"),
            "version {version}: {err}"
        );
    }
}

#[test]
fn missing_database_with_a_wal_is_refused() {
    let tmp = TempDir::new().expect("tempdir");
    fs::write(
        tmp.path().join("hostdevd.db-wal"),
        b"frames of a deleted db",
    )
    .expect("wal");
    let err = Store::open(tmp.path()).expect_err("must refuse");
    assert!(err.is_corrupt(), "{err}");
    assert!(
        !tmp.path().join(DB_FILE).exists(),
        "no new database created"
    );
}

#[test]
fn leftovers_of_an_interrupted_creation_are_replaced() {
    let tmp = TempDir::new().expect("tempdir");
    fs::write(tmp.path().join(NEW_DB_FILE), b"half-built").expect("leftover");
    fs::write(tmp.path().join("hostdevd.db.new-journal"), b"journal").expect("leftover");
    let store = Store::open(tmp.path()).expect("open");
    assert_eq!(store.load().expect("load"), Snapshot::default());
    assert!(!tmp.path().join(NEW_DB_FILE).exists());
    assert!(!tmp.path().join("hostdevd.db.new-journal").exists());
}

#[test]
fn columns_that_disagree_with_the_json_are_corrupt() {
    let tmp = TempDir::new().expect("tempdir");
    populated(tmp.path());
    let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
    conn.execute("UPDATE records SET consumer = NULL WHERE id = 3", [])
        .expect("tamper");
    drop(conn);
    let store = Store::open(tmp.path()).expect("open passes the page-level check");
    let err = store.load().expect_err("load must notice");
    assert!(err.is_corrupt(), "{err}");
    assert!(err.to_string().contains("record 3"), "{err}");

    let conn = Connection::open(tmp.path().join(DB_FILE)).expect("sqlite");
    drop(store);
    conn.execute(
        "UPDATE records SET consumer = NULL, record = '{\"id\":' WHERE id = 3",
        [],
    )
    .expect("tamper");
    drop(conn);
    let err = Store::open(tmp.path())
        .expect("open")
        .load()
        .expect_err("half-written JSON");
    assert!(
        err.to_string().contains("record 3 does not decode"),
        "{err}"
    );
}

/// Two present records at one address (only a hand-edited database has them) would
/// leave one claim beyond any release: load refuses them as corruption.
#[test]
fn two_present_records_at_one_address_are_corrupt() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    let mut cs = change(0, 2);
    cs.upserts = vec![record(1, 0, 1, Some(1)), record(2, 0, 2, None)];
    store
        .commit(&[cs])
        .expect("the store itself does not judge records");
    let err = store.load().expect_err("load must notice");
    assert!(err.is_corrupt(), "{err}");
    assert!(
        err.to_string()
            .contains("records 1 and 2 are both present at 0000:3b:02.0"),
        "{err}"
    );
}

#[test]
fn a_read_only_connection_rejects_the_batch_and_recovers() {
    let tmp = TempDir::new().expect("tempdir");
    let mut model = Model::default();
    let mut store = Store::open(tmp.path()).expect("open");
    let mut cs = change(0, 1);
    cs.upserts = vec![record(1, 0, 1, None)];
    store = commit_and_check(store, &mut model, &[cs]);

    // `query_only` makes SQLite answer writes with SQLITE_READONLY, as a read-only file
    // does, without needing a mount.
    store
        .conn
        .pragma_update(None, "query_only", true)
        .expect("query_only");
    let mut cs = change(1, 2);
    cs.upserts = vec![record(1, 0, 2, Some(3))];
    let err = store
        .commit(std::slice::from_ref(&cs))
        .expect_err("read-only");
    assert!(err.is_read_only(), "{err}");
    assert!(err.to_string().contains(DB_FILE), "{err}");
    assert_eq!(store.load().expect("reads still work"), model.snapshot());

    store
        .conn
        .pragma_update(None, "query_only", false)
        .expect("writable again");
    commit_and_check(store, &mut model, &[cs]);
}

#[test]
fn meta_values_survive_reopen_and_host_generation_is_reserved() {
    let tmp = TempDir::new().expect("tempdir");
    let mut store = Store::open(tmp.path()).expect("open");
    assert_eq!(store.meta_get("boot_id").expect("get"), None);
    store.meta_set("boot_id", "abc-123").expect("set");
    store.meta_set("boot_id", "def-456").expect("overwrite");
    store.commit(&[change(0, 12)]).expect("bump");
    let err = store
        .meta_set(HOST_GENERATION_KEY, "0")
        .expect_err("reserved");
    assert!(matches!(err, StoreError::ReservedKey { .. }), "{err}");
    drop(store);
    let store = reopen(tmp.path());
    assert_eq!(
        store.meta_get("boot_id").expect("get").as_deref(),
        Some("def-456")
    );
    assert_eq!(
        store.meta_get(HOST_GENERATION_KEY).expect("get").as_deref(),
        Some("12")
    );
}

#[test]
fn errors_keep_their_cause() {
    let tmp = TempDir::new().expect("tempdir");
    let first = Store::open(tmp.path()).expect("open");
    let err = Store::open(tmp.path()).expect_err("locked");
    assert!(std::error::Error::source(&err).is_some(), "{err:?}");
    drop(first);
    fs::write(tmp.path().join(DB_FILE), vec![0x42u8; 8192]).expect("garbage");
    let err = Store::open(tmp.path()).expect_err("corrupt");
    assert!(std::error::Error::source(&err).is_some(), "{err:?}");
}

#[test]
fn store_moves_to_the_writer_thread() {
    // The daemon's single writer owns the store on a blocking thread.
    fn assert_send<T: Send>() {}
    assert_send::<Store>();
    assert_send::<StoreError>();
}

#[test]
fn the_database_is_owner_only_and_an_older_open_one_is_tightened() {
    let dir = TempDir::new().expect("tempdir");
    let db = dir.path().join(DB_FILE);
    drop(reopen(dir.path()));
    assert_eq!(
        fs::metadata(&db).expect("db").permissions().mode() & 0o777,
        0o600
    );
    fs::set_permissions(&db, fs::Permissions::from_mode(0o644)).expect("chmod");
    drop(reopen(dir.path()));
    assert_eq!(
        fs::metadata(&db).expect("db").permissions().mode() & 0o777,
        0o600
    );
}
