//! Crash test of the store (invariants I4, I5): a child process drives the ledger and the
//! store, acknowledging each change only after `commit` returned, and is killed with
//! SIGKILL at random moments; after every kill the database must hold every
//! acknowledged change, nothing half-applied, and a host generation that never went back.
//!
//! The child is this same test binary re-executed on the `crash_child` test with an
//! environment variable naming the state directory; without the variable that test is a
//! no-op.

use std::collections::BTreeMap;
use std::io::{BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hostdevd::ledger::{
    ChangeSet, ClaimRequest, ClaimTarget, DeviceFacts, DeviceRecord, Ledger, Owner, ReleaseRequest,
};
use hostdevd::pci::{ConsumerId, DeviceId, Generation, PciAddress, RequestId, VendorId};
use hostdevd::store::{Store, DB_FILE};

/// Set in the child's environment to the state directory it works in.
const CHILD_ENV: &str = "HOSTDEVD_STORE_CRASH_CHILD_DIR";
const DEVICES: u8 = 16;
const CONSUMERS: u64 = 4;
/// The most change sets the child groups into one commit.
const MAX_BATCH: usize = 3;
/// Small, so the crash test also exercises pruning of the request log (on disk; memory
/// keeps half as many).
const REQUEST_LOG_LIMIT: usize = 50;
const ROUNDS: usize = 40;
/// The child gives up on its own if nobody killed it (the parent died).
const CHILD_LIFETIME: Duration = Duration::from_secs(30);

/// xorshift64*: enough randomness for delays and choices, no dependency.
struct Rng(u64);

impl Rng {
    fn seeded(salt: u64) -> Rng {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9);
        Rng((nanos ^ salt.rotate_left(32)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn address(i: u8) -> PciAddress {
    PciAddress::new(0, 0x81, i / 8, i % 8).expect("address")
}

fn consumer(n: u64) -> ConsumerId {
    ConsumerId(uuid::Uuid::from_u64_pair(0xc4a5_0000, n))
}

fn inventory() -> Vec<DeviceFacts> {
    (0..DEVICES)
        .map(|i| DeviceFacts {
            address: address(i),
            vendor_id: VendorId(0x8086),
            device_id: DeviceId(0x154c),
            driver: Some("vfio-pci".into()),
            // One group per device, so claims never block each other.
            iommu_group: Some(200 + u32::from(i)),
            numa_node: Some(0),
            physfn: None,
            is_pf: false,
            physnets: Vec::new(),
            managed: true,
            instance: None,
        })
        .collect()
}

/// An acknowledged operation, as the child printed it.
#[derive(Debug, Clone)]
struct Ack {
    address: PciAddress,
    /// The owner after the operation (None after a release).
    owner: Option<ConsumerId>,
    generation: Generation,
    consumer: ConsumerId,
    request_id: RequestId,
}

// ---- child -----------------------------------------------------------------------------

#[test]
fn crash_child() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return; // Only meaningful when the parent test starts it.
    };
    child_main(Path::new(&dir));
}

fn child_main(dir: &Path) {
    let started = Instant::now();
    let mut store = Store::open(dir).expect("child: open store");
    store.set_request_log_limit(REQUEST_LOG_LIMIT);
    let mut ledger = Ledger::from_snapshot(
        store
            .load_recent(REQUEST_LOG_LIMIT / 2)
            .expect("child: load"),
    );
    ledger.set_request_log_limit(REQUEST_LOG_LIMIT / 2);
    let mut out = std::io::stdout().lock();

    let cs = ledger.apply_inventory(inventory());
    if !cs.is_empty() {
        store
            .commit(std::slice::from_ref(&cs))
            .expect("child: commit inventory");
        writeln!(out, "ACK inventory {}", cs.host_generation).expect("stdout");
        out.flush().expect("stdout");
    }

    let mut rng = Rng::seeded(u64::from(std::process::id()));
    let mut serial = 0u64;
    while started.elapsed() < CHILD_LIFETIME {
        let batch_len = 1 + rng.below(MAX_BATCH as u64) as usize;
        let mut batch: Vec<ChangeSet> = Vec::new();
        let mut lines = Vec::new();
        for _ in 0..batch_len {
            let i = rng.below(u64::from(DEVICES)) as u8;
            let addr = address(i);
            let rec = ledger
                .record_at(addr)
                .expect("child: device present")
                .clone();
            serial += 1;
            let request_id: RequestId = format!("crash-{}-{serial}", std::process::id())
                .parse()
                .expect("request id");
            // `now` only orders the request log for pruning; the host generation grows
            // across restarts, unlike a counter local to this process.
            let now = ledger.host_generation().0;
            let (line, cs) = match &rec.claim {
                None => {
                    let who = consumer(rng.below(CONSUMERS));
                    let req = ClaimRequest {
                        target: ClaimTarget::Address {
                            address: addr,
                            expected_generation: rec.generation,
                        },
                        owner: Owner {
                            consumer: who,
                            label: "crash-test".parse().expect("label"),
                        },
                        request_id: request_id.clone(),
                    };
                    let (outcome, cs) = ledger.claim(&req, now).expect("child: claim");
                    let line = format!(
                        "ACK claim {addr} {who} {} {request_id}",
                        outcome.generation()
                    );
                    (line, cs)
                }
                Some(claim) => {
                    let who = claim.owner.consumer;
                    let req = ReleaseRequest {
                        address: addr,
                        consumer: who,
                        request_id: request_id.clone(),
                        generation: rec.generation,
                    };
                    let (outcome, cs) = ledger.release(&req, now).expect("child: release");
                    let line = format!(
                        "ACK release {addr} {who} {} {request_id}",
                        outcome.generation()
                    );
                    (line, cs)
                }
            };
            batch.push(cs);
            lines.push(line);
        }
        match store.commit(&batch) {
            Ok(()) => {
                // Only now is the change acknowledged.
                for line in &lines {
                    writeln!(out, "{line}").expect("stdout");
                }
                out.flush().expect("stdout");
                // As the agent's writer does after answering: a kill may land in it too.
                store
                    .prune_request_log()
                    .expect("child: prune the request log");
            }
            Err(e) => {
                eprintln!("child: commit failed, undoing: {e}");
                for cs in batch.iter().rev() {
                    ledger.undo(cs);
                }
            }
        }
    }
}

// ---- parent ----------------------------------------------------------------------------

fn parse_ack(line: &str) -> Option<Result<Ack, String>> {
    // libtest may print "test crash_child ... " on the same line before the first ack.
    let start = line.find("ACK ")?;
    let words: Vec<&str> = line[start..].split_whitespace().collect();
    let parse = || -> Result<Option<Ack>, String> {
        match words.as_slice() {
            ["ACK", kind @ ("claim" | "release"), addr, who, generation, request_id] => {
                let address: PciAddress = addr.parse().map_err(|e| format!("{e}"))?;
                let who: ConsumerId = who.parse().map_err(|e| format!("{e}"))?;
                let generation =
                    Generation(generation.parse().map_err(|e| format!("generation: {e}"))?);
                let request_id: RequestId = request_id.parse().map_err(|e| format!("{e}"))?;
                Ok(Some(Ack {
                    address,
                    owner: (*kind == "claim").then_some(who),
                    generation,
                    consumer: who,
                    request_id,
                }))
            }
            _ => Err(format!("unparsable ack line {line:?}")),
        }
    };
    match parse() {
        Ok(Some(ack)) => Some(Ok(ack)),
        Ok(None) => None,
        Err(e) => Some(Err(e)),
    }
}

/// Opens the database with plain SQLite and checks every row decodes and agrees with its
/// columns: no half-written record.
fn check_rows(dir: &Path) -> usize {
    let conn = rusqlite::Connection::open(dir.join(DB_FILE)).expect("raw open");
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .expect("integrity_check");
    assert_eq!(check, "ok", "integrity check");
    let mut stmt = conn
        .prepare("SELECT id, address, generation, present, consumer, record FROM records")
        .expect("prepare");
    let rows = stmt
        .query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, bool>(3)?,
                r.get::<_, Option<String>>(4)?,
                r.get::<_, String>(5)?,
            ))
        })
        .expect("query");
    let mut n = 0;
    for row in rows {
        let (id, addr, generation, present, owner, json) = row.expect("row");
        let rec: DeviceRecord = serde_json::from_str(&json)
            .unwrap_or_else(|e| panic!("record {id} is half-written ({e}): {json}"));
        assert_eq!(rec.id.0 as i64, id, "record {id}: id column");
        assert_eq!(
            rec.address().to_string(),
            addr,
            "record {id}: address column"
        );
        assert_eq!(
            rec.generation.0 as i64, generation,
            "record {id}: generation"
        );
        assert_eq!(rec.present, present, "record {id}: present column");
        assert_eq!(
            rec.claim.map(|c| c.owner.consumer.to_string()),
            owner,
            "record {id}: consumer column"
        );
        n += 1;
    }
    n
}

#[test]
fn kill_9_loses_no_acknowledged_change() {
    let tmp = tempfile::TempDir::new().expect("tempdir");
    let dir = tmp.path().join("state");
    let exe = std::env::current_exe().expect("current exe");
    let mut rng = Rng::seeded(0x5eed);
    let deadline = Instant::now() + Duration::from_secs(50);

    // What the disk must hold: per device, owner and generation of its last change.
    let mut expected: BTreeMap<PciAddress, (Option<ConsumerId>, Generation)> = BTreeMap::new();
    let mut expected_host = Generation(0);
    let mut disk_host = Generation(0);
    let mut inventory_on_disk = false;
    let mut recent: Vec<Ack> = Vec::new();
    let (mut acked_total, mut unacked_committed, mut rounds) = (0usize, 0usize, 0usize);

    for round in 0..ROUNDS {
        if Instant::now() > deadline {
            break;
        }
        rounds += 1;
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdout = child.stdout.take().expect("child stdout");
        let mut stderr = child.stderr.take().expect("child stderr");
        // Drain both pipes while the child runs, so it never blocks on a full pipe.
        let reader = std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = BufReader::new(stdout).read_to_end(&mut bytes);
            bytes
        });
        let err_reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        // Mostly short lives (kills during startup, open and the first commits), some
        // long enough for hundreds of commits.
        let delay = if round % 5 == 4 {
            60 + rng.below(120)
        } else {
            2 + rng.below(100)
        };
        std::thread::sleep(Duration::from_millis(delay));
        let _ = child.kill(); // SIGKILL
        let status = child.wait().expect("wait child");
        let lines = reader.join().expect("stdout reader");
        let errors = err_reader.join().expect("stderr reader");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "round {round}: the child must die by SIGKILL, not exit ({status}); stderr:\n{errors}"
        );

        // Only complete lines count: a line the kill cut short was never acknowledged.
        let text = String::from_utf8_lossy(&lines);
        let mut acks = Vec::new();
        for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
            if let Some(at) = line.find("ACK inventory ") {
                let generation = line[at + "ACK inventory ".len()..].trim();
                let generation = generation
                    .parse()
                    .unwrap_or_else(|e| panic!("round {round}: {line:?}: {e}"));
                expected_host = expected_host.max(Generation(generation));
                inventory_on_disk = true;
                continue;
            }
            match parse_ack(line) {
                Some(Ok(ack)) => acks.push(ack),
                Some(Err(e)) => panic!("round {round}: {e}"),
                None => {}
            }
        }
        for ack in &acks {
            expected.insert(ack.address, (ack.owner, ack.generation));
            expected_host = expected_host.max(ack.generation);
        }
        acked_total += acks.len();
        recent.extend(acks);
        let keep = recent.len().saturating_sub(10);
        recent.drain(..keep);

        // Reopen and compare.
        if !dir.join(DB_FILE).exists() {
            assert!(
                expected.is_empty() && !inventory_on_disk,
                "round {round}: database missing after acknowledged changes"
            );
            continue;
        }
        let store =
            Store::open(&dir).unwrap_or_else(|e| panic!("round {round}: reopen after kill: {e:?}"));
        let snap = store
            .load()
            .unwrap_or_else(|e| panic!("round {round}: load after kill: {e:?}"));
        drop(store);
        assert_eq!(check_rows(&dir), snap.records.len(), "round {round}: rows");

        assert!(
            snap.host_generation >= disk_host,
            "round {round}: host generation went backwards from {disk_host} to {}",
            snap.host_generation
        );
        assert!(
            snap.host_generation >= expected_host,
            "round {round}: host generation {} is below the acknowledged {expected_host}",
            snap.host_generation
        );
        let present: BTreeMap<PciAddress, &DeviceRecord> = snap
            .records
            .values()
            .filter(|r| r.present)
            .map(|r| (r.address(), r))
            .collect();
        assert_eq!(
            present.len(),
            snap.records.values().filter(|r| r.present).count(),
            "round {round}: two present records share an address"
        );
        // The inventory is one change set: all devices or none.
        assert!(
            snap.records.is_empty() || present.len() == usize::from(DEVICES),
            "round {round}: half an inventory on disk ({} records)",
            snap.records.len()
        );
        if inventory_on_disk {
            assert_eq!(
                present.len(),
                usize::from(DEVICES),
                "round {round}: inventory lost"
            );
        }

        let mut newer = 0;
        for (addr, (owner, generation)) in &expected {
            let rec = present
                .get(addr)
                .unwrap_or_else(|| panic!("round {round}: acknowledged device {addr} is gone"));
            let on_disk = rec.claim.as_ref().map(|c| c.owner.consumer);
            if rec.generation == *generation {
                assert_eq!(
                    on_disk, *owner,
                    "round {round}: {addr} at generation {generation}: owner on disk \
                     {on_disk:?}, acknowledged {owner:?}"
                );
            } else {
                assert!(
                    rec.generation > *generation,
                    "round {round}: LOST: {addr} is at generation {} on disk but generation \
                     {generation} ({owner:?}) was acknowledged",
                    rec.generation
                );
                // Only the batch in flight at the kill may be committed but unacknowledged.
                assert!(
                    rec.generation > expected_host,
                    "round {round}: {addr} at generation {} between acknowledged changes",
                    rec.generation
                );
                newer += 1;
            }
        }
        assert!(
            newer <= MAX_BATCH,
            "round {round}: {newer} devices changed beyond the acknowledgements"
        );
        unacked_committed += newer;
        // The most recent acknowledged requests are in the log with their first answer.
        for ack in &recent {
            let entry = snap
                .requests
                .iter()
                .find(|e| e.consumer == ack.consumer && e.request_id == ack.request_id);
            let entry = entry.unwrap_or_else(|| {
                panic!(
                    "round {round}: request {} of {} is missing from the log",
                    ack.request_id, ack.consumer
                )
            });
            assert_eq!(entry.outcome.generation(), ack.generation, "round {round}");
        }

        // The disk, now checked, is what the next child builds on.
        disk_host = snap.host_generation;
        expected_host = disk_host;
        if !present.is_empty() {
            inventory_on_disk = true;
        }
        for (addr, rec) in &present {
            expected.insert(
                *addr,
                (rec.claim.as_ref().map(|c| c.owner.consumer), rec.generation),
            );
        }
    }
    assert!(acked_total > 0, "the child never acknowledged a change");
    println!(
        "store crash test: {rounds} rounds, {acked_total} acknowledged changes, \
         {unacked_committed} committed before their ack, final host generation {disk_host}, \
         lost = 0"
    );
}
