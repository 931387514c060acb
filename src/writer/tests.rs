//! Unit tests of the writer's batches, decided on a worker directly (no thread), so that
//! what one batch holds is exact.

use tokio::sync::oneshot;

use super::*;
use crate::ledger::tests::{addr, facts, rid};
use crate::ledger::{ClaimTarget, DeviceFacts, Owner, Selector};
use crate::pci::OwnerLabel;

/// VF `i` of the PF at 0000:3b:00.0, in an IOMMU group of its own.
fn vf(i: u8) -> DeviceFacts {
    facts(
        &format!("0000:3b:02.{i}"),
        Some(40 + u32::from(i)),
        Some("0000:3b:00.0"),
    )
}

fn consumer(n: u128) -> ConsumerId {
    ConsumerId(uuid::Uuid::from_u128(n))
}

/// A worker over a fresh store with four free VFs, keeping `in_memory` request-log
/// entries in memory.
fn worker(dir: &std::path::Path, in_memory: usize) -> Worker {
    let mut ledger = Ledger::new();
    ledger.set_request_log_limit(in_memory);
    let store = Store::open(dir).expect("store");
    let mut w = Worker::new(ledger, store, EventBuffer::events(64), None);
    let (reply, _rx) = oneshot::channel();
    w.apply_batch(vec![Command::Inventory(
        (0..4).map(vf).collect(),
        None,
        reply,
    )]);
    w
}

/// A worker over a fresh store in `dir` that acts on the hardware of `tree`, with
/// `inventory` applied.
fn hardware_worker(
    dir: &std::path::Path,
    tree: &crate::simhost::FakeTree,
    inventory: Vec<DeviceFacts>,
) -> Worker {
    let hardware = Hardware {
        sysfs_root: tree.sysfs_root().to_path_buf(),
        step_timeout: std::time::Duration::from_secs(10),
        vf_count_timeout: std::time::Duration::from_secs(10),
    };
    let store = Store::open(dir).expect("store");
    let mut w = Worker::new(
        Ledger::new(),
        store,
        EventBuffer::events(64),
        Some(hardware),
    );
    let (reply, rx) = oneshot::channel();
    w.apply_batch(vec![Command::Inventory(inventory, None, reply)]);
    answer(rx).expect("inventory");
    w
}

type Answer = oneshot::Receiver<Result<Applied, WriteError>>;

fn claim(who: u128, request_id: &str, target: ClaimTarget) -> (Command, Answer) {
    let (reply, rx) = oneshot::channel();
    let req = ClaimRequest {
        target,
        owner: Owner {
            consumer: consumer(who),
            label: OwnerLabel::try_from(String::new()).expect("label"),
        },
        request_id: rid(request_id),
    };
    (Command::Claim(req, reply), rx)
}

/// A claim of any free VF.
fn claim_any(who: u128, request_id: &str) -> (Command, Answer) {
    claim(who, request_id, ClaimTarget::Selector(Selector::default()))
}

fn answer<T>(mut rx: oneshot::Receiver<T>) -> T {
    rx.try_recv().expect("answered when the batch is done")
}

fn claimed(w: &Worker) -> usize {
    w.view_now()
        .devices()
        .iter()
        .filter(|v| v.record.claim.is_some())
        .count()
}

/// With room for two entries in memory, the three claims after the first push its entry
/// out (the window drops its oldest by time, then by key, and the whole batch shares one
/// second), before the commit has put it on disk. Its retry in the same batch must still
/// be answered as the first time (I7): the same device, no second claim.
#[test]
fn a_retry_in_the_same_batch_is_replayed_after_memory_dropped_its_entry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 2);
    let (first, first_rx) = claim_any(1, "boot");
    let (mut batch, mut others) = (vec![first], Vec::new());
    for n in 2..=4 {
        let (c, rx) = claim_any(n, "other");
        batch.push(c);
        others.push(rx);
    }
    let (retry, retry_rx) = claim_any(1, "boot");
    batch.push(retry);
    w.apply_batch(batch);

    let first = answer(first_rx).expect("first claim");
    let retry = answer(retry_rx).expect("the retry is answered");
    assert!(retry.replayed, "the retry replays the first answer");
    assert_eq!(retry.outcome, first.outcome);
    for rx in others {
        answer(rx).expect("other claims");
    }
    assert_eq!(claimed(&w), 4, "one claim per consumer, none twice");
}

/// GetRequestOutcome decided after the claim it asks about, in the same batch and after
/// memory dropped the claim's entry, reports it applied and closes nothing.
#[test]
fn get_request_outcome_in_the_same_batch_sees_the_claim_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 2);
    let (first, first_rx) = claim_any(1, "boot");
    let mut batch = vec![first];
    for n in 2..=4 {
        batch.push(claim_any(n, "other").0);
    }
    let (reply, settle_rx) = oneshot::channel();
    batch.push(Command::Settle {
        consumer: consumer(1),
        request_id: rid("boot"),
        close: true,
        reply,
    });
    w.apply_batch(batch);

    let first = answer(first_rx).expect("claim");
    let entry = answer(settle_rx)
        .expect("settled")
        .expect("the claim is applied");
    assert_eq!(entry.outcome, first.outcome);
    assert!(!w.closed.is_closed(consumer(1), &rid("boot")));
}

fn claim_at(
    who: u128,
    request_id: &str,
    address: PciAddress,
    expected: Generation,
) -> (Command, Answer) {
    let target = ClaimTarget::Address {
        address,
        expected_generation: expected,
    };
    claim(who, request_id, target)
}

fn release(
    who: u128,
    request_id: &str,
    address: PciAddress,
    generation: Generation,
) -> ReleaseRequest {
    ReleaseRequest {
        address,
        consumer: consumer(who),
        request_id: rid(request_id),
        generation,
    }
}

/// A release that runs alone (the device holds a recorded binding, here its next
/// owner's) and retries one that memory no longer holds: answered from the store, as in
/// a batch, not decided again against the claim as it is now.
#[test]
fn a_release_run_alone_recalls_its_retry_from_the_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 2);
    let (c, rx) = claim_any(1, "boot");
    w.apply_batch(vec![c]);
    let first = answer(rx).expect("claim").outcome;
    let x = first.address();
    let freed = w
        .release_restoring(&release(1, "stop", x, first.generation()))
        .expect("release")
        .outcome;
    let (c, rx) = claim_at(2, "next", x, freed.generation());
    w.apply_batch(vec![c]);
    let next = answer(rx).expect("the next owner's claim").outcome;
    let (bound, cs) = w
        .ledger
        .record_binding(x, consumer(2), next.generation(), vec![], None)
        .expect("binding");
    w.commit_one(cs).expect("commit");
    assert!(w.acts_on_hardware(&Command::Release(
        release(1, "stop", x, first.generation()),
        true,
        oneshot::channel().0
    )));
    // Three more entries push the release out of memory.
    let others: Vec<Command> = (3..=5).map(|n| claim_any(n, "other").0).collect();
    w.apply_batch(others);
    assert!(!w.ledger.knows_request(consumer(1), &rid("stop")));

    let retried = w
        .release_restoring(&release(1, "stop", x, first.generation()))
        .expect("the retry is answered from the store");
    assert!(retried.replayed);
    assert_eq!(retried.outcome, freed);
    let now = w.view_now();
    let rec = now
        .device(x)
        .map(|v| v.record)
        .find(|r| r.present)
        .expect("present");
    assert_eq!(rec.generation, bound, "nothing changed");
    assert_eq!(rec.claim.map(|c| c.owner.consumer), Some(consumer(2)));
}

/// A batch whose commit fails: the second claim of one device was refused because of the
/// first, which is undone, so its refusal may not stand (it would name an owner and a
/// generation that never reached the disk). A refusal decided before anything in the
/// batch changed stands.
#[test]
fn a_failed_commit_takes_back_refusals_that_rested_on_what_it_undid() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 64);
    let (x, y) = (addr("0000:3b:02.0"), addr("0000:3b:02.1"));
    let g = w
        .view_now()
        .device(x)
        .map(|v| v.record.generation)
        .next()
        .expect("x");
    let (stale, stale_rx) = claim_at(3, "stale", y, Generation(g.0 + 100));
    let (first, first_rx) = claim_at(1, "first", x, g);
    let (second, second_rx) = claim_at(2, "second", x, g);
    w.store.refuse_writes(true);
    w.apply_batch(vec![stale, first, second]);
    w.store.refuse_writes(false);

    let stale = answer(stale_rx).expect_err("stale");
    assert!(
        matches!(
            stale,
            WriteError::Ledger(LedgerError::StaleGeneration { address, .. }) if address == y
        ),
        "decided before any change, it stands: {stale}"
    );
    for rx in [first_rx, second_rx] {
        let e = answer(rx).expect_err("the batch failed");
        assert!(matches!(e, WriteError::Store(_)), "{e}");
    }
    assert_eq!(claimed(&w), 0);
}

/// A retry of a committed claim in a batch whose commit fails: decided before anything
/// changed, its replayed answer rests on the log on disk and stands. An earlier version
/// answered it with the batch's error ("not made") though the claim is held.
#[test]
fn a_failed_commit_leaves_a_replay_decided_before_it_standing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 64);
    let (x, y) = (addr("0000:3b:02.0"), addr("0000:3b:02.1"));
    let gen_of = |w: &Worker, a| {
        w.view_now()
            .device(a)
            .map(|v| v.record.generation)
            .next()
            .expect("present")
    };
    let g = gen_of(&w, x);
    let (c, rx) = claim_at(1, "boot", x, g);
    w.apply_batch(vec![c]);
    let first = answer(rx).expect("claim");
    let (retry, retry_rx) = claim_at(1, "boot", x, g);
    let (other, other_rx) = claim_at(2, "other", y, gen_of(&w, y));
    w.store.refuse_writes(true);
    w.apply_batch(vec![retry, other]);
    w.store.refuse_writes(false);
    let replayed = answer(retry_rx).expect("the replay stands");
    assert!(replayed.replayed);
    assert_eq!(replayed.outcome, first.outcome);
    let e = answer(other_rx).expect_err("the new claim was not made");
    assert!(matches!(e, WriteError::Store(_)), "{e}");
    assert_eq!(claimed(&w), 1);
}

/// GetRequestOutcome closes an id it answers "not applied"; if its batch then fails to
/// commit, it answers the error and the id stays open.
#[test]
fn a_failed_commit_takes_back_the_close_it_answered_with_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 64);
    let (c, claim_rx) = claim_any(1, "boot");
    let (reply, settle_rx) = oneshot::channel();
    let settle = Command::Settle {
        consumer: consumer(9),
        request_id: rid("lost"),
        close: true,
        reply,
    };
    w.store.refuse_writes(true);
    w.apply_batch(vec![c, settle]);
    w.store.refuse_writes(false);

    assert!(matches!(answer(claim_rx), Err(WriteError::Store(_))));
    assert!(matches!(answer(settle_rx), Err(WriteError::Store(_))));
    assert!(!w.closed.is_closed(consumer(9), &rid("lost")));
    // Asked again with the store back, it is answered and closed.
    let (reply, settle_rx) = oneshot::channel();
    w.apply_batch(vec![Command::Settle {
        consumer: consumer(9),
        request_id: rid("lost"),
        close: true,
        reply,
    }]);
    assert_eq!(answer(settle_rx).expect("answered"), None);
    assert!(w.closed.is_closed(consumer(9), &rid("lost")));
}

/// A release the service did not check (its generation was not the device's when the
/// service looked) frees nothing, even when the device has reached that generation by
/// the time the writer decides; the same release checked frees it, and an unchecked
/// retry of a logged release is replayed. Before, the writer freed it unchecked: a
/// generation is guessable (one host-wide counter), and a detach applied in between
/// moved the device to it while QEMU could still hold its VFIO node.
#[test]
fn an_unchecked_release_frees_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 64);
    let (c, claim_rx) = claim_any(1, "boot");
    w.apply_batch(vec![c]);
    let first = answer(claim_rx).expect("claimed").outcome;
    let (address, g) = (first.address(), first.generation());
    let send = |checked: bool, request_id: &str| {
        let (reply, rx) = oneshot::channel();
        (
            Command::Release(release(1, request_id, address, g), checked, reply),
            rx,
        )
    };
    let (unchecked, rx) = send(false, "r1");
    w.apply_batch(vec![unchecked]);
    let e = answer(rx).expect_err("not checked");
    assert!(
        matches!(e, WriteError::ChangedWhileChecked { generation, .. } if generation == g),
        "{e}"
    );
    assert_eq!(claimed(&w), 1, "nothing freed");
    let (checked, rx) = send(true, "r1");
    w.apply_batch(vec![checked]);
    let freed = answer(rx).expect("checked: freed");
    assert!(!freed.replayed);
    assert_eq!(claimed(&w), 0);
    let (retry, rx) = send(false, "r1");
    w.apply_batch(vec![retry]);
    let again = answer(rx).expect("an unchecked retry of a logged release");
    assert!(again.replayed && again.outcome == freed.outcome);
}

/// An id closed by an earlier answer stays closed when it is asked about again in a
/// batch that fails: only the close the failed batch made is taken back. Before, the
/// failed batch reopened it, and the lost call it was closed against could apply after
/// the client had been told it never would.
#[test]
fn a_failed_commit_keeps_a_close_answered_before_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 64);
    let settle = || {
        let (reply, rx) = oneshot::channel();
        (
            Command::Settle {
                consumer: consumer(9),
                request_id: rid("lost"),
                close: true,
                reply,
            },
            rx,
        )
    };
    let (first, first_rx) = settle();
    w.apply_batch(vec![first]);
    assert_eq!(answer(first_rx).expect("answered"), None);
    let (c, claim_rx) = claim_any(1, "boot");
    let (again, again_rx) = settle();
    w.store.refuse_writes(true);
    w.apply_batch(vec![c, again]);
    w.store.refuse_writes(false);
    assert!(matches!(answer(claim_rx), Err(WriteError::Store(_))));
    assert!(matches!(answer(again_rx), Err(WriteError::Store(_))));
    assert!(
        w.closed.is_closed(consumer(9), &rid("lost")),
        "closed by the first answer"
    );
}

/// An acting audit's free of one orphan is a request of its own (`<audit>@<address>`): one
/// whose id GetRequestOutcome closed is refused, as a claim or release would be. Before,
/// the audit freed it anyway, after its client had been told it never would.
#[test]
fn an_orphan_free_with_a_closed_id_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 64);
    let (c, claim_rx) = claim_any(1, "boot");
    w.apply_batch(vec![c]);
    let applied = answer(claim_rx).expect("claimed");
    let address = applied.outcome.address();
    let audit = rid("audit-1");
    let id = audit.per_device(address).expect("per-device id");
    let (reply, settle_rx) = oneshot::channel();
    w.apply_batch(vec![Command::Settle {
        consumer: consumer(1),
        request_id: id.clone(),
        close: true,
        reply,
    }]);
    assert_eq!(answer(settle_rx).expect("answered"), None);
    let (reply, freed_rx) = oneshot::channel();
    w.apply_batch(vec![Command::FreeOrphans(
        audit,
        vec![OrphanFree {
            address,
            consumer: consumer(1),
            generation: applied.outcome.generation(),
            request_id: id,
        }],
        reply,
    )]);
    let freed = answer(freed_rx).expect("answered");
    assert!(
        matches!(&freed.results[..], [Err(WriteError::RequestClosed { .. })]),
        "{:?}",
        freed.results
    );
    assert_eq!(claimed(&w), 1, "still claimed");
}

/// The store's health clears only when a commit goes through: a batch with nothing to
/// write (a lookup) after a failed commit leaves the failure showing.
#[test]
fn a_batch_with_nothing_to_write_leaves_the_last_commit_error_showing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 64);
    let (c, claim_rx) = claim_any(1, "boot");
    w.store.refuse_writes(true);
    w.apply_batch(vec![c]);
    w.store.refuse_writes(false);
    assert!(answer(claim_rx).is_err());
    let errors = w.store_error.clone();
    let error = || errors.lock().expect("lock").clone();
    assert!(error().is_some(), "the failed commit shows");
    let (reply, settle_rx) = oneshot::channel();
    w.apply_batch(vec![Command::Settle {
        consumer: consumer(9),
        request_id: rid("nothing"),
        close: false,
        reply,
    }]);
    assert_eq!(answer(settle_rx).expect("answered"), None);
    assert!(error().is_some(), "a lookup wrote nothing: still failing");
    let (c, claim_rx) = claim_any(1, "again");
    w.apply_batch(vec![c]);
    answer(claim_rx).expect("claimed");
    assert!(error().is_none(), "cleared by a commit that went through");
}

/// Every event has a generation of its own, above the host generation a watcher started
/// from, even where a state changed without its record changing: a PF whose VF was
/// claimed, a free VF that a domain now uses. So a watcher that resumes from any event it
/// received gets exactly the events after it, and the host generation committed with the
/// batch is the last event's.
#[test]
fn every_event_has_its_own_generation_and_resuming_from_any_misses_none() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 16);
    let (reply, _rx) = oneshot::channel();
    w.apply_batch(vec![Command::Devices(
        vec![(
            addr("0000:3b:00.0"),
            Some(facts("0000:3b:00.0", Some(39), None)),
        )],
        None,
        reply,
    )]);
    let start = w.view_now().host_generation;
    let claim_at = |w: &Worker, who: u128, request_id: &str, a: &str| {
        let address = addr(a);
        let generation = w
            .view_now()
            .device(address)
            .next()
            .expect("present")
            .record
            .generation;
        claim(
            who,
            request_id,
            ClaimTarget::Address {
                address,
                expected_generation: generation,
            },
        )
    };
    // The PF becomes unavailable with its VF's claim; its record does not change.
    let (c, rx) = claim_at(&w, 1, "vf0", "0000:3b:02.0");
    w.apply_batch(vec![c]);
    answer(rx).expect("claimed");
    // A domain takes a free VF: only derived states change.
    let (reply, rx) = oneshot::channel();
    w.apply_batch(vec![Command::Domains(
        vec![crate::ledger::tests::domain(9, "vm9", &["0000:3b:02.3"])],
        reply,
    )]);
    answer(rx).expect("domains applied");

    let log = w.events.lock().expect("log");
    let (events, _) = log.resume(start).expect("resumable");
    let at = |a: &str| {
        events
            .iter()
            .filter(
                |e| matches!(e, Event::Changed { view, .. } if view.record.address() == addr(a)),
            )
            .count()
    };
    assert_eq!(at("0000:3b:00.0"), 1, "the PF's derived change: {events:?}");
    assert_eq!(at("0000:3b:02.0"), 1, "the claim");
    assert_eq!(at("0000:3b:02.3"), 1, "the domain's VF: {events:?}");
    let gens: Vec<Generation> = events.iter().map(Event::generation).collect();
    assert!(gens[0] > start, "{gens:?} after {start}");
    assert!(
        gens.windows(2).all(|p| p[0] < p[1]),
        "strictly increasing: {gens:?}"
    );
    let last = *gens.last().expect("events");
    assert_eq!(w.view_now().host_generation, last);
    // The domains' batch stored nothing else: it stored its events' generations, so that
    // no restart hands them out again, however many such batches come before a change.
    assert_eq!(w.store.host_generation().expect("stored"), last);
    for (k, g) in gens.iter().enumerate() {
        let (rest, _) = log.resume(*g).expect("resumable");
        let rest: Vec<Generation> = rest.iter().map(Event::generation).collect();
        assert_eq!(rest, gens[k + 1..], "resumed from {g}");
    }
    drop(log);
    // Beside a change, the derived events' generations are not written on their own; the
    // next change takes a generation past them, and its commit stores that.
    let (c, rx) = claim_at(&w, 2, "vf1", "0000:3b:02.1");
    w.apply_batch(vec![c]);
    let next = answer(rx).expect("claimed").outcome.generation();
    assert!(next > last, "{next} after {last}");
    assert_eq!(w.store.host_generation().expect("stored"), next);
}

/// A worker with hardware actions over a host of PF `pf` with 4 VFs (groups 20..23) and,
/// when given, one more device (group 30); with the tree and the VFs' addresses.
fn pf_worker(
    dir: &std::path::Path,
    pf: &str,
    other: Option<&str>,
) -> (Worker, crate::simhost::FakeTree, Vec<PciAddress>) {
    let mut sys = crate::simhost::FakeSys::new();
    sys.pf(pf, 0x8086, 0x1572, 8, 4);
    if let Some(o) = other {
        sys.device(o, 0x8086, 0x1572);
    }
    let tree = sys.build();
    let mut inventory = vec![facts(pf, Some(10), None)];
    inventory[0].is_pf = true;
    let vfs = sys.vfs(pf);
    for (i, a) in vfs.iter().enumerate() {
        inventory.push(facts(&a.to_string(), Some(20 + i as u32), Some(pf)));
    }
    if let Some(o) = other {
        inventory.push(facts(o, Some(30), None));
    }
    let w = hardware_worker(dir, &tree, inventory);
    (w, tree, vfs)
}

/// A VF count change as the writer carries it out: begun alone (checked, its devices
/// held back), written off the writer's thread (here, in place), and recorded alone.
fn set_vf_count(w: &mut Worker, req: SetVfCount) -> Result<VfCountSet, WriteError> {
    let (reply, rx) = oneshot::channel();
    w.run_alone(Command::BeginVfCount(req, reply));
    let written = match answer(rx)? {
        VfBegun::Change(change) => change.write(),
        VfBegun::Replayed(first) => return Ok(first),
    };
    let (reply, rx) = oneshot::channel();
    w.run_alone(Command::EndVfCount(Box::new(written), reply));
    answer(rx)
}

/// While a VF count is being written, the writer decides the host's other requests: a
/// claim of another device lands, a claim of a VF of that PF is refused (the kernel is
/// destroying it) without changing anything, and once the change is recorded the VFs
/// it destroyed are gone.
#[test]
fn requests_are_decided_while_a_vf_count_is_written() {
    let pf = "0000:3b:00.0";
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut w, _tree, vfs) = pf_worker(dir.path(), pf, Some("0000:5e:00.0"));
    let view = w.view_now();
    let generation = |a: PciAddress| view.device(a).next().expect("present").record.generation;
    let (reply, rx) = oneshot::channel();
    w.run_alone(Command::BeginVfCount(
        SetVfCount {
            pf: addr(pf),
            generation: generation(addr(pf)),
            count: 2,
            autoprobe: None,
            request: None,
        },
        reply,
    ));
    let VfBegun::Change(change) = answer(rx).expect("begun") else {
        panic!("no request id: nothing to replay");
    };
    let (c, other) = claim(
        1,
        "other",
        ClaimTarget::Address {
            address: addr("0000:5e:00.0"),
            expected_generation: generation(addr("0000:5e:00.0")),
        },
    );
    let (v, held) = claim(
        2,
        "held",
        ClaimTarget::Address {
            address: vfs[0],
            expected_generation: generation(vfs[0]),
        },
    );
    w.apply_batch(vec![c, v]);
    answer(other).expect("another device is claimed meanwhile");
    let err = answer(held).expect_err("a VF of the PF being changed");
    assert!(
        matches!(err, WriteError::Ledger(LedgerError::VfCountChanging { .. })),
        "{err:?}"
    );
    let written = change.write();
    let (reply, rx) = oneshot::channel();
    w.run_alone(Command::EndVfCount(Box::new(written), reply));
    let set = answer(rx).expect("recorded");
    assert_eq!(set.before, 4);
    let now = w.view_now();
    assert!(vfs.iter().all(|a| now.device(*a).next().is_none()));
    assert_eq!(
        w.store
            .load()
            .expect("load")
            .records
            .values()
            .filter(|r| r.claim.is_some())
            .count(),
        1,
        "the claim made meanwhile is durable"
    );
}

/// GetRequestOutcome (a Settle that closes) for the request id of a VF count change still
/// being written: it must not answer "never applied", and must close nothing, since the
/// change is then recorded under that id.
#[test]
fn a_request_outcome_asked_while_its_vf_count_is_written_closes_nothing() {
    let pf = "0000:3b:00.0";
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut w, _tree, _vfs) = pf_worker(dir.path(), pf, None);
    let settle = |w: &mut Worker, close: bool| {
        let (reply, rx) = oneshot::channel();
        w.apply_batch(vec![Command::Settle {
            consumer: consumer(1),
            request_id: rid("vfs"),
            close,
            reply,
        }]);
        answer(rx)
    };
    let begin = |w: &mut Worker, pf: &str| {
        let generation = w
            .view_now()
            .device(addr(pf))
            .next()
            .expect("present")
            .record
            .generation;
        let (reply, rx) = oneshot::channel();
        w.run_alone(Command::BeginVfCount(
            SetVfCount {
                pf: addr(pf),
                generation,
                count: 2,
                autoprobe: None,
                request: Some((consumer(1), rid("vfs"))),
            },
            reply,
        ));
        answer(rx)
    };
    let Ok(VfBegun::Change(change)) = begin(&mut w, pf) else {
        panic!("a new request: a change begins");
    };
    for close in [true, false] {
        let err = settle(&mut w, close).expect_err("still being written");
        assert!(
            matches!(&err, WriteError::RequestInProgress { pf: p, .. } if *p == addr(pf)),
            "{err:?}"
        );
    }
    let written = change.write();
    let (reply, rx) = oneshot::channel();
    w.run_alone(Command::EndVfCount(Box::new(written), reply));
    let set = answer(rx).expect("recorded");
    let entry = settle(&mut w, true)
        .expect("answered")
        .expect("the change is logged under its id, which was never closed");
    assert!(
        matches!(entry.outcome, Outcome::VfCountSet { generation, .. } if generation == set.generation),
        "{entry:?}"
    );
    // Over: the id answers as logged, and a retry replays it.
    let Ok(VfBegun::Replayed(again)) = begin(&mut w, pf) else {
        panic!("a retry of a recorded change is replayed");
    };
    assert_eq!(again.generation, set.generation);
}

/// A claim or release that reuses the request id of a VF count change still being
/// written is refused as in progress and changes nothing: were it applied and logged
/// under that id, the change's own record would find the id taken, and a retry of either
/// would be answered with the other's outcome.
#[test]
fn a_claim_reusing_the_id_of_a_vf_count_change_under_way_is_refused() {
    let pf = "0000:3b:00.0";
    let other = "0000:5e:00.0";
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut w, _tree, _vfs) = pf_worker(dir.path(), pf, Some(other));
    let generation = |w: &Worker, a: &str| {
        w.view_now()
            .device(addr(a))
            .next()
            .expect("present")
            .record
            .generation
    };
    let claimed_at = |rx: Answer| match answer(rx).expect("claimed").outcome {
        Outcome::Claimed { generation, .. } => generation,
        other => panic!("{other:?}"),
    };
    let (cmd, rx) = claim_at(1, "first", addr(other), generation(&w, other));
    w.apply_batch(vec![cmd]);
    let first = claimed_at(rx);
    let (reply, rx) = oneshot::channel();
    w.run_alone(Command::BeginVfCount(
        SetVfCount {
            pf: addr(pf),
            generation: generation(&w, pf),
            count: 2,
            autoprobe: None,
            request: Some((consumer(1), rid("vfs"))),
        },
        reply,
    ));
    let Ok(VfBegun::Change(change)) = answer(rx) else {
        panic!("a new request: a change begins");
    };
    let in_progress = |err: &WriteError| {
        assert!(
            matches!(err, WriteError::RequestInProgress { pf: p, .. } if *p == addr(pf)),
            "{err:?}"
        );
    };
    let (reply, rx) = oneshot::channel();
    w.apply_batch(vec![Command::Release(
        release(1, "vfs", addr(other), first),
        true,
        reply,
    )]);
    in_progress(&answer(rx).expect_err("a release under the change's id"));
    assert_eq!(claimed(&w), 1, "the refused release freed nothing");
    let (reply, rx) = oneshot::channel();
    w.apply_batch(vec![Command::Release(
        release(1, "rel", addr(other), first),
        true,
        reply,
    )]);
    answer(rx).expect("a release under its own id");
    let (cmd, rx) = claim_at(1, "vfs", addr(other), generation(&w, other));
    w.apply_batch(vec![cmd]);
    in_progress(&answer(rx).expect_err("a claim under the change's id"));
    assert_eq!(claimed(&w), 0, "the refused claim took nothing");
    // Another consumer's request of the same id is its own.
    let (cmd, rx) = claim_at(2, "vfs", addr(other), generation(&w, other));
    w.apply_batch(vec![cmd]);
    claimed_at(rx);
    let written = change.write();
    let (reply, rx) = oneshot::channel();
    w.run_alone(Command::EndVfCount(Box::new(written), reply));
    let set = answer(rx).expect("the change is recorded under its own id");
    let entry = w.ledger.request(consumer(1), &rid("vfs")).expect("logged");
    assert!(
        matches!(entry.outcome, Outcome::VfCountSet { generation, .. } if generation == set.generation),
        "{entry:?}"
    );
}

/// A VF count change whose record the store refuses (a full disk) leaves the ledger
/// listing the VFs the kernel destroyed: the PF and those VFs stay held back, after the
/// disk takes writes again too, until a full scan commits, and refusing them changes
/// nothing; the host's other devices are claimed meanwhile.
#[test]
fn a_vf_count_change_the_store_refused_holds_its_devices_until_a_full_scan() {
    let pf = "0000:3b:00.0";
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut w, _tree, vfs) = pf_worker(dir.path(), pf, Some("0000:5e:00.0"));
    let generation = |w: &Worker, a: PciAddress| {
        w.view_now()
            .device(a)
            .next()
            .expect("present")
            .record
            .generation
    };
    let change = SetVfCount {
        pf: addr(pf),
        generation: generation(&w, addr(pf)),
        count: 2,
        autoprobe: None,
        request: Some((consumer(3), rid("vfs"))),
    };
    // GetRequestOutcome for the change's request id (closing it if not found).
    let outcome = |w: &mut Worker| {
        let (reply, rx) = oneshot::channel();
        w.apply_batch(vec![Command::Settle {
            consumer: consumer(3),
            request_id: rid("vfs"),
            close: true,
            reply,
        }]);
        answer(rx)
    };
    w.store.refuse_writes(true);
    let err = set_vf_count(&mut w, change).expect_err("the record refused");
    w.store.refuse_writes(false);
    assert!(matches!(err, WriteError::Store(_)), "{err:?}");
    // Written, not recorded, its devices held: under way as far as its id goes.
    let asked = outcome(&mut w);
    assert!(
        matches!(asked, Err(WriteError::RequestInProgress { .. })),
        "{asked:?}"
    );
    let stored = w.store.load().expect("load");
    let claims = |w: &mut Worker, who: u128| {
        let (v, vf_rx) = claim(
            who,
            &format!("old-vf-{who}"),
            ClaimTarget::Address {
                address: vfs[0],
                expected_generation: generation(w, vfs[0]),
            },
        );
        let (p, pf_rx) = claim(
            who + 1,
            &format!("pf-{who}"),
            ClaimTarget::Address {
                address: addr(pf),
                expected_generation: generation(w, addr(pf)),
            },
        );
        w.apply_batch(vec![p, v]);
        (answer(vf_rx), answer(pf_rx))
    };
    let (vf, pf_claim) = claims(&mut w, 1);
    for refused in [vf.map(|_| ()), pf_claim.map(|_| ())] {
        assert!(
            matches!(
                refused,
                Err(WriteError::Ledger(LedgerError::VfCountChanging { .. }))
            ),
            "{refused:?}"
        );
    }
    assert_eq!(
        w.store.load().expect("load"),
        stored,
        "refusals change nothing"
    );
    let (other, other_rx) = claim(
        5,
        "other",
        ClaimTarget::Address {
            address: addr("0000:5e:00.0"),
            expected_generation: generation(&w, addr("0000:5e:00.0")),
        },
    );
    w.apply_batch(vec![other]);
    answer(other_rx).expect("another device is claimed meanwhile");
    // A scan of the PF's devices alone is no full scan: still held.
    let (reply, rx) = oneshot::channel();
    w.apply_batch(vec![Command::Devices(vec![(vfs[3], None)], None, reply)]);
    answer(rx).expect("a VF's removal applied");
    let (vf, _) = claims(&mut w, 7);
    assert!(vf.is_err(), "{vf:?}");
    // The full scan finds the PF with two VFs, and lets them go.
    let mut inventory = vec![facts(pf, Some(10), None)];
    inventory[0].is_pf = true;
    for (i, a) in vfs.iter().take(2).enumerate() {
        inventory.push(facts(&a.to_string(), Some(20 + i as u32), Some(pf)));
    }
    inventory.push(facts("0000:5e:00.0", Some(30), None));
    let (reply, rx) = oneshot::channel();
    w.apply_batch(vec![Command::Inventory(inventory.clone(), None, reply)]);
    answer(rx).expect("the full scan applied");
    // Held no more, and still not "never applied": the PF shows what it has.
    for _ in 0..2 {
        let asked = outcome(&mut w);
        assert!(
            matches!(asked, Err(WriteError::VfCountNotRecorded { pf: p, .. }) if p == addr(pf)),
            "{asked:?}"
        );
    }
    // The same id sent again with the PF's generation now (another count: the same one
    // would write nothing) goes through and is logged: its outcome is then the logged one.
    let again = SetVfCount {
        pf: addr(pf),
        generation: generation(&w, addr(pf)),
        count: 3,
        autoprobe: None,
        request: Some((consumer(3), rid("vfs"))),
    };
    let set = set_vf_count(&mut w, again).expect("written and recorded");
    let logged = outcome(&mut w)
        .expect("answered")
        .expect("logged under its id");
    assert!(
        matches!(logged.outcome, Outcome::VfCountSet { generation, .. } if generation == set.generation),
        "{logged:?}"
    );
    // The PF's two VFs as the scan found them, for what follows.
    let (reply, rx) = oneshot::channel();
    w.apply_batch(vec![Command::Inventory(inventory, None, reply)]);
    answer(rx).expect("the full scan applied again");
    let (vf, pf_claim) = claims(&mut w, 9);
    pf_claim.expect("the PF is claimable");
    assert!(
        matches!(vf, Err(WriteError::Ledger(LedgerError::Blocked { .. }))),
        "the VF the scan found, no longer held back, but blocked by its PF's claim: {vf:?}"
    );
}

/// A VF count written takes the PF's old VFs away in the same commit as the PF's new
/// generation: a claim that presents an old VF's generation, decided after the write and
/// before any rescan, finds no device (the kernel destroyed it), and never lands on the
/// VF the kernel created again at that address.
#[test]
fn a_claim_after_a_vf_count_write_and_before_the_rescan_finds_no_old_vf() {
    let pf = "0000:3b:00.0";
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut w, tree, vfs) = pf_worker(dir.path(), pf, None);
    let view = w.view_now();
    let generation = |a: PciAddress| view.device(a).next().expect("present").record.generation;
    let old_vf = generation(vfs[0]);

    let result = set_vf_count(
        &mut w,
        SetVfCount {
            pf: addr(pf),
            generation: generation(addr(pf)),
            count: 2,
            autoprobe: None,
            request: None,
        },
    );
    let set = result.expect("written");
    assert_eq!(set.before, 4);
    let numvfs = std::fs::read_to_string(tree.device_dir(pf).join("sriov_numvfs")).expect("numvfs");
    assert_eq!(numvfs.trim(), "2");
    let now = w.view_now();
    assert!(
        vfs.iter().all(|a| now.device(*a).next().is_none()),
        "old VFs gone"
    );
    assert_eq!(
        now.device(addr(pf)).next().expect("PF").record.generation,
        set.generation
    );
    assert_eq!(
        w.store.load().expect("load").records.len(),
        1,
        "durable with it"
    );

    // A count the PF cannot show is refused before anything is written: the autoprobe
    // setting stays, and so does the PF's generation.
    let pf_generation = set.generation;
    tree.write_attr(pf, "sriov_numvfs", b"x\n");
    let autoprobe =
        || std::fs::read_to_string(tree.device_dir(pf).join("sriov_drivers_autoprobe")).ok();
    let autoprobe_before = autoprobe();
    let result = set_vf_count(
        &mut w,
        SetVfCount {
            pf: addr(pf),
            generation: pf_generation,
            count: 1,
            autoprobe: Some(false),
            request: None,
        },
    );
    let err = result.expect_err("unreadable count");
    assert!(
        matches!(err, WriteError::Hardware(HardwareError::Read { .. })),
        "{err:?}"
    );
    assert_eq!(autoprobe(), autoprobe_before, "nothing written");
    assert_eq!(
        w.view_now()
            .device(addr(pf))
            .next()
            .expect("PF")
            .record
            .generation,
        pf_generation
    );

    let (c, rx) = claim(
        1,
        "late",
        ClaimTarget::Address {
            address: vfs[0],
            expected_generation: old_vf,
        },
    );
    w.apply_batch(vec![c]);
    let err = answer(rx).expect_err("no such device until the rescan");
    assert!(
        matches!(err, WriteError::Ledger(LedgerError::UnknownDevice { .. })),
        "{err:?}"
    );
}

/// A VF count change logged under a request id, retried once memory no longer holds the
/// entry: answered from the store as the first call (the count before it, the generation
/// it gave the PF), with nothing written again; the same ids with another count are
/// refused. A change that failed part way is not logged.
#[test]
fn a_vf_count_change_is_replayed_from_the_store() {
    let pf = "0000:3b:00.0";
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut w, tree, _vfs) = pf_worker(dir.path(), pf, Some("0000:5e:00.0"));
    w.ledger.set_request_log_limit(2);
    let pf_generation = |w: &Worker| {
        w.view_now()
            .device(addr(pf))
            .next()
            .expect("PF")
            .record
            .generation
    };
    let g = pf_generation(&w);
    let change = |count, request_id: &str| SetVfCount {
        pf: addr(pf),
        generation: g,
        count,
        autoprobe: None,
        request: Some((consumer(1), rid(request_id))),
    };
    let first = set_vf_count(&mut w, change(2, "vfs")).expect("written");
    assert_eq!((first.before, first.replayed), (4, false));
    // Two claims and their releases push the entry out of memory: it is the oldest
    // (written first, and with the lowest consumer id where the second is the same).
    for n in 7..=8 {
        let (c, rx) = claim_any(n, "other");
        w.apply_batch(vec![c]);
        let claimed = answer(rx).expect("claim").outcome;
        w.release_restoring(&release(n, "free", claimed.address(), claimed.generation()))
            .expect("release");
    }
    assert!(!w.ledger.knows_request(consumer(1), &rid("vfs")));
    tree.write_attr(pf, "sriov_numvfs", b"3\n");
    let again = set_vf_count(&mut w, change(2, "vfs")).expect("replayed");
    assert_eq!(
        again,
        VfCountSet {
            generation: first.generation,
            before: 4,
            replayed: true,
        }
    );
    let numvfs = std::fs::read_to_string(tree.device_dir(pf).join("sriov_numvfs")).expect("numvfs");
    assert_eq!(numvfs.trim(), "3", "nothing written again");
    let err = set_vf_count(&mut w, change(1, "vfs")).expect_err("another count");
    assert!(
        matches!(err, WriteError::Ledger(LedgerError::RequestIdReused { .. })),
        "{err:?}"
    );

    // A count the PF cannot show fails before anything is written: nothing is logged.
    tree.write_attr(pf, "sriov_numvfs", b"x\n");
    let now = pf_generation(&w);
    let err = set_vf_count(
        &mut w,
        SetVfCount {
            generation: now,
            ..change(1, "unread")
        },
    )
    .expect_err("unreadable count");
    assert!(matches!(err, WriteError::Hardware(_)), "{err:?}");
    assert_eq!(
        w.store
            .request(consumer(1), &rid("unread"))
            .expect("lookup"),
        None
    );
}
/// A commit whose COMMIT fails with an I/O error (a failed fsync) may be in the log on
/// disk or not: its callers hear that the outcome is unknown, never "not made", and the
/// writer decides nothing more (the agent stops; its next start reads back what the disk
/// holds). A full disk, where nothing reached the log, is only a refused batch.
#[test]
fn a_commit_whose_outcome_is_unknown_stops_the_writer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 16);
    let failed = w.failed_tx.subscribe();

    w.store.fail_next_commit(rusqlite::ffi::SQLITE_FULL);
    let (c, rx) = claim_any(1, "full");
    w.apply_batch(vec![c]);
    let err = answer(rx).expect_err("disk full");
    assert!(matches!(err, WriteError::Store(_)), "{err:?}");
    assert!(
        w.failed.is_none() && !*failed.borrow(),
        "a full disk is not fatal"
    );

    w.store.fail_next_commit(rusqlite::ffi::SQLITE_IOERR_FSYNC);
    let (c, rx) = claim_any(2, "fsync");
    let (refused, refused_rx) = claim(
        3,
        "stale",
        ClaimTarget::Address {
            address: vf(3).address,
            expected_generation: Generation(1),
        },
    );
    w.apply_batch(vec![refused, c]);
    let err = answer(rx).expect_err("fsync failed");
    assert!(matches!(err, WriteError::OutcomeUnknown(_)), "{err:?}");
    assert!(err.to_string().contains("may or may not"), "{err}");
    // Decided before anything that was undone: its refusal stands.
    assert!(matches!(
        answer(refused_rx),
        Err(WriteError::Ledger(LedgerError::StaleGeneration { .. }))
    ));
    assert!(*failed.borrow(), "the agent is told to stop");
    assert_eq!(claimed(&w), 0, "memory as before the batch");

    // From now on nothing is decided, by a batch or alone.
    let (c, rx) = claim_any(4, "after");
    w.run_batch(vec![c]);
    assert!(matches!(answer(rx), Err(WriteError::StoreFailed(_))));
    let result = set_vf_count(
        &mut w,
        SetVfCount {
            pf: addr("0000:3b:00.0"),
            generation: Generation(1),
            count: 0,
            autoprobe: None,
            request: None,
        },
    );
    assert!(matches!(result, Err(WriteError::StoreFailed(_))));
    assert!(
        w.store
            .load()
            .expect("load")
            .records
            .values()
            .all(|r| r.claim.is_none()),
        "nothing committed after the failure"
    );
}

/// An acting audit whose orphans run alone (one holds a recorded binding to give back):
/// once one orphan's commit has an unknown outcome, the rest are refused, with no sysfs
/// write and no commit after it. An earlier version went on freeing the next orphans (a
/// commit after the one the agent stops for) and cleared the store's failure with them.
#[test]
fn an_audit_stops_freeing_at_a_commit_whose_outcome_is_unknown() {
    let mut sys = crate::simhost::FakeSys::new();
    sys.pf("0000:3b:00.0", 0x8086, 0x1572, 8, 0);
    let tree = sys.build();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = hardware_worker(dir.path(), &tree, (0..4).map(vf).collect());
    let (x, y) = (vf(0).address, vf(1).address);
    let mut orphans = Vec::new();
    for (who, a) in [(1, x), (2, y)] {
        let g = w
            .view_now()
            .device(a)
            .next()
            .expect("free")
            .record
            .generation;
        let (c, rx) = claim_at(who, "boot", a, g);
        w.apply_batch(vec![c]);
        let claimed = answer(rx).expect("claim").outcome.generation();
        orphans.push((who, a, claimed));
    }
    // x holds a binding of no members: giving it back writes nothing, but the audit's
    // frees run alone.
    let (bound, cs) = w
        .ledger
        .record_binding(x, consumer(1), orphans[0].2, vec![], None)
        .expect("binding");
    w.commit_one(cs).expect("commit");
    orphans[0].2 = bound;
    let frees: Vec<OrphanFree> = orphans
        .iter()
        .map(|&(who, a, generation)| OrphanFree {
            address: a,
            consumer: consumer(who),
            generation,
            request_id: rid("audit").per_device(a).expect("id"),
        })
        .collect();
    let audit = Command::FreeOrphans(rid("audit"), frees, oneshot::channel().0);
    assert!(w.acts_on_hardware(&audit));

    w.store.fail_next_commit(rusqlite::ffi::SQLITE_IOERR_FSYNC);
    let (reply, rx) = oneshot::channel();
    let Command::FreeOrphans(id, frees, _) = audit else {
        unreachable!()
    };
    w.run_alone(Command::FreeOrphans(id, frees, reply));
    let freed = answer(rx).expect("answered per orphan");
    assert!(
        matches!(freed.results[0], Err(WriteError::OutcomeUnknown(_))),
        "{:?}",
        freed.results[0]
    );
    assert!(
        matches!(freed.results[1], Err(WriteError::StoreFailed(_))),
        "the next orphan is refused: {:?}",
        freed.results[1]
    );
    let stored = w.store.load().expect("load");
    assert!(
        stored
            .records
            .values()
            .any(|r| r.address() == y && r.claim.is_some()),
        "nothing was committed after the unknown outcome"
    );
    assert!(
        w.store_error.lock().expect("lock").is_some(),
        "the failure is still reported"
    );
}

/// A scan's sysfs details go out in the view of the commit that holds its facts, and
/// stay in every later view; a commit that fails publishes neither, and later batches
/// keep the details that went with the ledger as it is.
#[test]
fn a_scans_sysfs_details_go_out_with_its_facts_or_not_at_all() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 16);
    let new_vf = addr("0000:3b:02.4");
    let mut device = crate::sysfs::PciDevice::new(new_vf);
    device.driver = Some("ixgbevf".into());
    let details: SysfsDevices = [(new_vf, Arc::new(device))].into_iter().collect();
    // A rescan of the new VF (`None`: gone) with the details after it.
    let rescan = |w: &mut Worker, fact: Option<DeviceFacts>, details: SysfsDevices| {
        let (reply, rx) = oneshot::channel();
        w.apply_batch(vec![Command::Devices(
            vec![(new_vf, fact)],
            Some(details),
            reply,
        )]);
        answer(rx)
    };
    let fact = facts("0000:3b:02.4", Some(44), Some("0000:3b:00.0"));
    rescan(&mut w, Some(fact), details).expect("rescan committed");
    let driver = |v: &View| v.sysfs_device(&new_vf).and_then(|d| d.driver.clone());
    // The VF present in the ledger, with its driver, in one view.
    let present_with_driver = |w: &Worker, why: &str| {
        let view = w.view_now();
        assert!(
            view.ledger.record_at(new_vf).is_some_and(|r| r.present),
            "{why}"
        );
        assert_eq!(driver(&view).as_deref(), Some("ixgbevf"), "{why}");
    };
    present_with_driver(&w, "published with the facts");

    // The device goes, but the disk is full: neither its record nor its details change.
    w.store.fail_next_commit(rusqlite::ffi::SQLITE_FULL);
    let failed = rescan(&mut w, None, SysfsDevices::new());
    assert!(matches!(failed, Err(WriteError::Store(_))), "{failed:?}");
    // A later batch that is not a scan publishes the details as they were.
    let (c, rx) = claim_any(1, "after");
    w.apply_batch(vec![c]);
    answer(rx).expect("claimed");
    present_with_driver(&w, "kept with the record");

    // Once the removal commits, both go in the same view.
    rescan(&mut w, None, SysfsDevices::new()).expect("removal committed");
    let view = w.view_now();
    assert!(view.ledger.record_at(new_vf).is_none());
    assert_eq!(driver(&view), None);
}

/// A decision that panics (here: the worker's lock poisoned as a panic mid-decision
/// leaves it) stops the agent as an unknown commit outcome does: every change is refused
/// from then on, and `failed` resolves with the reason, so the daemon exits and its next
/// start reads back what the disk holds. Before, the writer thread just ended: every
/// change was refused as "shutting down" while the agent went on serving stale reads,
/// and nothing restarted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_mid_decision_stops_the_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(dir.path()).expect("store");
    let (writer, thread) = Writer::start(Ledger::new(), store, 64).expect("writer");
    let core = writer.core.clone();
    let poisoned = std::thread::spawn(move || {
        let _held = core.worker.lock().expect("not yet poisoned");
        panic!("a decision panics (on purpose, for this test)");
    })
    .join();
    assert!(poisoned.is_err());
    let (cmd, _) = claim_any(1, "after");
    let Command::Claim(req, _) = cmd else {
        unreachable!()
    };
    let refused = tokio::time::timeout(std::time::Duration::from_secs(10), writer.claim(req))
        .await
        .expect("answered");
    assert!(refused.is_err(), "{refused:?}");
    tokio::time::timeout(std::time::Duration::from_secs(10), writer.failed())
        .await
        .expect("the agent is told to stop");
    let why = writer.failure().expect("a reason");
    assert!(why.contains("panic"), "{why}");
    drop(writer);
    thread.join().expect("the writer thread ended");
}

/// A caller that committed in place yields to the watchers its commit woke, and only
/// then: with nobody watching, the yield would only delay its answer.
#[test]
fn a_commit_says_whether_it_sent_its_events_to_a_watcher() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = worker(dir.path(), 16);
    w.woke_watchers = false;
    let (c, rx) = claim_any(1, "nobody-watches");
    w.apply_batch(vec![c]);
    answer(rx).expect("claimed");
    assert!(!w.woke_watchers, "no watcher was there to be woken");
    let from = w.view_now().host_generation;
    let (_, mut watcher) = w
        .events
        .lock()
        .expect("events")
        .resume(from)
        .expect("resumable");
    let (c, rx) = claim_any(2, "one-watches");
    w.apply_batch(vec![c]);
    answer(rx).expect("claimed");
    assert!(
        std::mem::take(&mut w.woke_watchers),
        "the watcher was sent the claim"
    );
    assert!(watcher.try_recv().is_ok(), "and it has the event");
    // A refusal publishes nothing, so it wakes nobody.
    let (c, rx) = claim(
        3,
        "refused",
        ClaimTarget::Address {
            address: addr("0000:3b:02.7"),
            expected_generation: Generation(1),
        },
    );
    w.apply_batch(vec![c]);
    assert!(answer(rx).is_err(), "no such device");
    assert!(!w.woke_watchers, "nothing was published");
}
