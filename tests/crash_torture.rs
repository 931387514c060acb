//! Crash torture over gRPC: the real `hostdevd serve` binary, many concurrent clients
//! claiming and releasing VFs, SIGKILL at random moments, restarted on the same state dir.
//!
//! Every round starts the daemon on the same state directory and checks it against what
//! the clients were told before the last kill:
//!
//! - every acknowledged claim and release is there (owner and generation exactly);
//! - every request that was in flight at the kill is resolved with GetRequestOutcome by
//!   (owner, request id): recorded means applied (and then the device shows it), not
//!   recorded means not applied (and the device does not show it) — nothing half-applied;
//! - every request the daemon rejected is not recorded and changed nothing;
//! - no device is ever claimed while another consumer holds it (double owner), and no
//!   address has two present records;
//! - the host generation never goes back across restarts, nor any device's generation.
//!
//! Some rounds kill the daemon during its start (store open, scan, first inventory).
//!
//! Bounded for CI: 30 rounds by default, stopping early after about 50 s on a loaded
//! machine. The long run is `HOSTDEVD_TORTURE_ROUNDS=500 cargo test --release --test
//! crash_torture -- --nocapture` (what `make torture` runs); `HOSTDEVD_TORTURE_SEED`
//! replays a seed's choices (the kill moments still depend on timing). The last line is a
//! summary: rounds, operations, acknowledged changes, in-flight at kill, lost, double
//! owners, generation regressions.

mod support;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hostdevd::api::proto::{self};
use hostdevd::client::Client;
use hostdevd::simhost::{FakeSys, FakeTree};
use tonic::Code;
use tonic_types::StatusExt;

use support::Daemon;

const PF: &str = "0000:3b:00.0";
const VFS: u32 = 16;
const CLIENTS: u128 = 8;
/// The most devices one client holds before it prefers releasing.
const MAX_HELD: usize = 2;
const DEFAULT_ROUNDS: usize = 30;
/// The default (CI) run stops early after this long, however many rounds are left.
const DEFAULT_BUDGET: Duration = Duration::from_secs(50);
const ROUNDS_ENV: &str = "HOSTDEVD_TORTURE_ROUNDS";
const SEED_ENV: &str = "HOSTDEVD_TORTURE_SEED";

/// xorshift64*: enough randomness for delays and choices, no dependency.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn consumer(client: u128) -> String {
    uuid::Uuid::from_u128(0x7047_0000_0000_0000_0000_0000_0000_0000 | client).to_string()
}

fn owner(client: u128) -> proto::Owner {
    proto::Owner {
        consumer_id: consumer(client),
        label: format!("torture-client-{client}"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Claim,
    Release,
}

/// One mutating request a client sent, and what became of it.
#[derive(Debug, Clone)]
struct Sent {
    client: u128,
    op: Op,
    request_id: String,
    /// The address named in the request (None for a claim by selector).
    address: Option<String>,
    result: Result_,
}

#[derive(Debug, Clone)]
enum Result_ {
    /// The daemon answered OK: the change is acknowledged.
    Acked { address: String, generation: u64 },
    /// The daemon answered with an error of its own (it carries hostdev ErrorInfo).
    Rejected { code: Code },
    /// No answer: the connection broke (the kill). Applied or not, GetRequestOutcome says.
    InFlight { error: String },
}

/// What the ledger must hold for one VF.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Expect {
    owner: Option<u128>,
    generation: u64,
    /// The request id of the claim, when claimed.
    claim_request: Option<String>,
}

#[derive(Debug, Default)]
struct Figures {
    rounds: usize,
    startup_kills: usize,
    operations: usize,
    acknowledged: usize,
    rejected: usize,
    in_flight: usize,
    in_flight_applied: usize,
    lost: usize,
    half_applied: usize,
    double_owners: usize,
    generation_regressions: usize,
    max_host_generation: u64,
}

/// An answer from the daemon itself carries google.rpc.ErrorInfo in domain hostdev.v1;
/// a broken connection (the kill) does not.
fn from_daemon(s: &tonic::Status) -> bool {
    s.get_details_error_info()
        .is_some_and(|i| i.domain == "hostdev.v1")
}

fn config(tree: &FakeTree, dir: &Path) -> String {
    format!(
        "sysfs_root = {:?}\ndev_root = {:?}\nstate_dir = {:?}\n\
         [api]\nsocket = {:?}\nsocket_mode = \"0600\"\nwriter_uids = [{}]\n\
         [log]\nfilter = \"warn\"\n\
         [libvirt]\nuri = \"test:///default\"\npoll_interval_ms = 1000\n\
         [[devices]]\npf_name = \"ens1f0\"\nvf = true\n",
        tree.sysfs_root(),
        tree.dev_root(),
        dir.join("state"),
        dir.join("hostdevd.sock"),
        nix::unistd::getuid().as_raw(),
    )
}

fn spawn_daemon(cfg: &Path, log: &Path) -> Daemon {
    let log = File::options()
        .create(true)
        .append(true)
        .open(log)
        .expect("daemon log");
    Daemon(
        Command::new(env!("CARGO_BIN_EXE_hostdevd"))
            .args(["serve", "--config"])
            .arg(cfg)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start hostdevd"),
    )
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Waits until the daemon serves (the socket is bound only after the store is loaded and
/// the first inventory applied).
async fn wait_ready(d: &mut Daemon, socket: &Path, log: &Path) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = d.0.try_wait().expect("try_wait") {
            panic!(
                "hostdevd exited during start ({status}); its log:\n{}",
                log_tail(log)
            );
        }
        if let Ok(mut c) = hostdevd::client::connect(socket).await {
            if c.get_status(proto::GetStatusRequest {}).await.is_ok() {
                return c;
            }
        }
        assert!(
            Instant::now() < deadline,
            "hostdevd did not serve within 30 s; its log:\n{}",
            log_tail(log)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn kill9(d: &mut Daemon) {
    use std::os::unix::process::ExitStatusExt;
    let _ = d.0.kill(); // SIGKILL
    let status = d.0.wait().expect("wait for the killed daemon");
    // A daemon that had already exited on its own would be a finding, not a kill.
    assert!(
        status.signal() == Some(libc::SIGKILL),
        "the daemon was expected to die by SIGKILL, but ended with {status}"
    );
}

/// One client's life in a round: claims (by selector, or by address with the generation
/// it just read) and releases (of what it holds, with the generation of its ack), until
/// the connection breaks.
async fn client_loop(
    socket: PathBuf,
    client: u128,
    mut held: Vec<(String, u64)>,
    vfs: Arc<Vec<String>>,
    round: usize,
    mut rng: Rng,
    log: Arc<Mutex<Vec<Sent>>>,
) {
    let Ok(mut c) = hostdevd::client::connect(&socket).await else {
        return;
    };
    let push = |s: Sent| log.lock().expect("client log").push(s);
    for n in 0.. {
        let request_id = format!("t{round}-c{client}-{n}");
        let release = !held.is_empty() && (held.len() >= MAX_HELD || rng.below(2) == 0);
        if release {
            let i = rng.below(held.len() as u64) as usize;
            let (address, generation) = held[i].clone();
            let r = c
                .release(proto::ReleaseRequest {
                    address: address.clone(),
                    owner: Some(owner(client)),
                    request_id: request_id.clone(),
                    generation,
                })
                .await;
            let (result, stop) = match r {
                Ok(ok) => {
                    let ok = ok.into_inner();
                    held.remove(i);
                    (
                        Result_::Acked {
                            address: ok.address,
                            generation: ok.generation,
                        },
                        false,
                    )
                }
                Err(s) if from_daemon(&s) => (Result_::Rejected { code: s.code() }, false),
                Err(s) => (
                    Result_::InFlight {
                        error: s.to_string(),
                    },
                    true,
                ),
            };
            push(Sent {
                client,
                op: Op::Release,
                request_id,
                address: Some(address),
                result,
            });
            if stop {
                return;
            }
            continue;
        }
        // A claim: by selector, or by address with the generation just read (racing the
        // other clients, so often stale or already claimed).
        let (target, address) = if rng.below(2) == 0 {
            (
                proto::claim_request::Target::Selector(proto::Selector {
                    pf_address: PF.into(),
                    ..Default::default()
                }),
                None,
            )
        } else {
            let a = vfs[rng.below(vfs.len() as u64) as usize].clone();
            let Ok(d) = c
                .get_device(proto::GetDeviceRequest { address: a.clone() })
                .await
            else {
                return; // The daemon is gone; a read changes nothing.
            };
            let generation = d
                .into_inner()
                .device
                .map(|d| d.generation)
                .unwrap_or_default();
            (
                proto::claim_request::Target::Address(proto::ByAddress {
                    address: a.clone(),
                    expected_generation: generation,
                }),
                Some(a),
            )
        };
        let r = c
            .claim(proto::ClaimRequest {
                vfio: false,
                owner: Some(owner(client)),
                request_id: request_id.clone(),
                target: Some(target),
            })
            .await;
        let (result, stop) = match r {
            Ok(ok) => {
                let ok = ok.into_inner();
                let got = ok.device.map(|d| d.address).unwrap_or_default();
                held.push((got.clone(), ok.generation));
                (
                    Result_::Acked {
                        address: got,
                        generation: ok.generation,
                    },
                    false,
                )
            }
            Err(s) if from_daemon(&s) => (Result_::Rejected { code: s.code() }, false),
            Err(s) => (
                Result_::InFlight {
                    error: s.to_string(),
                },
                true,
            ),
        };
        push(Sent {
            client,
            op: Op::Claim,
            request_id,
            address,
            result,
        });
        if stop {
            return;
        }
    }
}

/// The state the clients start a round from: what each one holds, with generations.
fn holdings(model: &BTreeMap<String, Expect>, client: u128) -> Vec<(String, u64)> {
    model
        .iter()
        .filter(|(_, e)| e.owner == Some(client))
        .map(|(a, e)| (a.clone(), e.generation))
        .collect()
}

struct Checker {
    model: BTreeMap<String, Expect>,
    /// The highest host generation seen or acknowledged so far.
    high_water: u64,
    figures: Figures,
    violations: Vec<String>,
}

impl Checker {
    fn violation(&mut self, v: String) {
        eprintln!("crash torture VIOLATION: {v}");
        self.violations.push(v);
    }

    /// Checks the freshly restarted daemon against everything the last round's clients
    /// were told, resolving the requests that were in flight at the kill.
    async fn verify(&mut self, c: &mut Client, round: usize, sent: Vec<Sent>) {
        let status = c
            .get_status(proto::GetStatusRequest {})
            .await
            .expect("status after restart")
            .into_inner();
        if status.host_generation < self.high_water {
            self.figures.generation_regressions += 1;
            let hw = self.high_water;
            self.violation(format!(
                "round {round}: host generation {} after restart is below {hw}, already seen or acknowledged",
                status.host_generation
            ));
        }

        // Every change the daemon made in the last round, in the order it made them.
        let mut applied: Vec<(u64, u128, Op, String, String)> = Vec::new();
        for s in &sent {
            let consumer_id = consumer(s.client);
            match &s.result {
                Result_::Acked {
                    address,
                    generation,
                } => applied.push((
                    *generation,
                    s.client,
                    s.op,
                    address.clone(),
                    s.request_id.clone(),
                )),
                Result_::Rejected { code } => {
                    // A rejection changes nothing and is not recorded.
                    let out = c
                        .get_request_outcome(proto::GetRequestOutcomeRequest {
                            consumer_id,
                            request_id: s.request_id.clone(),
                        })
                        .await;
                    match out {
                        Err(e) if e.code() == Code::NotFound => {}
                        other => {
                            self.figures.half_applied += 1;
                            self.violation(format!(
                                "round {round}: request {} was rejected with {code:?} but its outcome is {other:?}",
                                s.request_id
                            ));
                        }
                    }
                }
                Result_::InFlight { error } => {
                    self.figures.in_flight += 1;
                    let out = c
                        .get_request_outcome(proto::GetRequestOutcomeRequest {
                            consumer_id,
                            request_id: s.request_id.clone(),
                        })
                        .await;
                    match out {
                        Ok(o) => {
                            let o = o.into_inner();
                            let want = match s.op {
                                Op::Claim => "claimed",
                                Op::Release => "released",
                            };
                            if o.operation != want
                                || s.address.as_ref().is_some_and(|a| *a != o.address)
                            {
                                self.figures.half_applied += 1;
                                self.violation(format!(
                                    "round {round}: in-flight {:?} {} of {:?} has outcome {o:?}",
                                    s.op, s.request_id, s.address
                                ));
                                continue;
                            }
                            self.figures.in_flight_applied += 1;
                            applied.push((
                                o.generation,
                                s.client,
                                s.op,
                                o.address,
                                s.request_id.clone(),
                            ));
                        }
                        Err(e) if e.code() == Code::NotFound => {}
                        Err(e) => panic!(
                            "round {round}: GetRequestOutcome for {} (in flight: {error}): {e:?}",
                            s.request_id
                        ),
                    }
                }
            }
        }
        applied.sort();
        for w in applied.windows(2) {
            if w[0].0 == w[1].0 {
                let v = format!(
                    "round {round}: two changes share generation {}: {:?} and {:?}",
                    w[0].0, w[0], w[1]
                );
                self.violation(v);
            }
        }
        for (generation, client, op, address, request_id) in applied {
            self.high_water = self.high_water.max(generation);
            let Some(e) = self.model.get(&address).cloned() else {
                self.violation(format!(
                    "round {round}: {op:?} {request_id} applied to unknown device {address}"
                ));
                continue;
            };
            if generation <= e.generation {
                self.figures.generation_regressions += 1;
                self.violation(format!(
                    "round {round}: {op:?} {request_id} on {address} at generation {generation}, not above the device's {}",
                    e.generation
                ));
            }
            let next = match op {
                Op::Claim => {
                    if let Some(holder) = e.owner {
                        self.figures.double_owners += 1;
                        self.violation(format!(
                            "round {round}: DOUBLE OWNER: {address} claimed by client {client} ({request_id}, generation {generation}) while client {holder} held it since generation {}",
                            e.generation
                        ));
                    }
                    Expect {
                        owner: Some(client),
                        generation,
                        claim_request: Some(request_id),
                    }
                }
                Op::Release => {
                    if e.owner != Some(client) {
                        self.violation(format!(
                            "round {round}: {address} released by client {client} ({request_id}) but held by {:?}",
                            e.owner
                        ));
                    }
                    Expect {
                        owner: None,
                        generation,
                        claim_request: None,
                    }
                }
            };
            self.model.insert(address, next);
        }

        // The ledger now must be exactly the model: nothing lost, nothing extra.
        let list = c
            .list_devices(proto::ListDevicesRequest {})
            .await
            .expect("list after restart")
            .into_inner();
        let mut present: BTreeMap<String, &proto::Device> = BTreeMap::new();
        for d in list.devices.iter().filter(|d| d.present) {
            if present.insert(d.address.clone(), d).is_some() {
                self.figures.double_owners += 1;
                let v = format!("round {round}: two present records at {}", d.address);
                self.violation(v);
            }
            if d.generation > list.host_generation {
                let v = format!(
                    "round {round}: {} has generation {} above the host generation {}",
                    d.address, d.generation, list.host_generation
                );
                self.violation(v);
            }
        }
        let expected = self.model.clone();
        for (address, want) in &expected {
            let Some(d) = present.get(address) else {
                self.figures.lost += 1;
                self.violation(format!("round {round}: LOST: device {address} is gone"));
                continue;
            };
            let owner = d.owner.as_ref().map(|o| o.consumer_id.clone());
            let want_owner = want.owner.map(consumer);
            let request = (!d.request_id.is_empty()).then(|| d.request_id.clone());
            if d.generation != want.generation
                || owner != want_owner
                || request != want.claim_request
            {
                if d.generation < want.generation {
                    self.figures.generation_regressions += 1;
                }
                // Acknowledged (or recorded) state that is not on the device is lost; a
                // device ahead of every recorded outcome is a half-applied change.
                if d.generation > want.generation {
                    self.figures.half_applied += 1;
                } else {
                    self.figures.lost += 1;
                }
                self.violation(format!(
                    "round {round}: {address}: the ledger has owner {owner:?} request {request:?} at generation {}, expected owner {want_owner:?} request {:?} at generation {}",
                    d.generation, want.claim_request, want.generation
                ));
            }
            let state = if want.owner.is_some() {
                proto::DeviceState::Claimed
            } else {
                proto::DeviceState::Free
            };
            if d.state != state as i32 {
                let v = format!(
                    "round {round}: {address} is in state {} but should be {state:?}",
                    d.state
                );
                self.violation(v);
            }
        }
        self.high_water = self.high_water.max(list.host_generation);
        self.figures.max_host_generation = self.high_water;
    }
}

fn build_host() -> FakeTree {
    let mut f = FakeSys::new();
    f.pf(PF, 0x8086, 0x1572, 64, VFS)
        .driver(PF, "i40e")
        .netdev(PF, "ens1f0");
    f.iommu_group(PF, 10)
        .vf_iommu_groups(PF, 100)
        .vf_driver(PF, "iavf");
    f.build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_concurrent_clients_loses_nothing() {
    let env_rounds = std::env::var(ROUNDS_ENV).ok().map(|v| {
        v.parse::<usize>()
            .expect("HOSTDEVD_TORTURE_ROUNDS is a number")
    });
    let rounds = env_rounds.unwrap_or(DEFAULT_ROUNDS);
    let budget = env_rounds.is_none().then_some(DEFAULT_BUDGET);
    let seed = std::env::var(SEED_ENV)
        .ok()
        .map(|v| v.parse::<u64>().expect("HOSTDEVD_TORTURE_SEED is a number"))
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x5eed)
        });
    eprintln!("crash torture: seed {seed} ({SEED_ENV}), up to {rounds} rounds");
    let mut rng = Rng::new(seed);

    let tree = build_host();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("config.toml");
    std::fs::write(&cfg_path, config(&tree, dir.path())).expect("config");
    let socket = dir.path().join("hostdevd.sock");
    let log = dir.path().join("hostdevd.log");
    let vfs: Arc<Vec<String>> = Arc::new(
        (0..VFS)
            .map(|i| format!("0000:3b:{:02x}.{}", 0x10 + i / 8, i % 8))
            .collect(),
    );

    let started = Instant::now();
    let mut checker = Checker {
        model: BTreeMap::new(),
        high_water: 0,
        figures: Figures::default(),
        violations: Vec::new(),
    };
    let mut last_round: Vec<Sent> = Vec::new();
    let mut have_model = false;
    for round in 0..=rounds {
        let last = round == rounds || budget.is_some_and(|b| started.elapsed() > b);
        // Every few rounds the kill lands during the start itself.
        if !last && round % 6 == 5 {
            let mut d = spawn_daemon(&cfg_path, &log);
            tokio::time::sleep(Duration::from_millis(rng.below(120))).await;
            // The daemon never ends by itself in its first 120 ms: a crash while it
            // recovers is a failure, not a kill saved.
            if let Some(status) = d.0.try_wait().expect("try_wait") {
                panic!(
                    "the daemon ended by itself during its start ({status}) in round {round}\ndaemon log tail:\n{}",
                    log_tail(&log)
                );
            }
            kill9(&mut d);
            checker.figures.startup_kills += 1;
        }
        let mut d = spawn_daemon(&cfg_path, &log);
        let mut c = wait_ready(&mut d, &socket, &log).await;
        if have_model {
            checker
                .verify(&mut c, round, std::mem::take(&mut last_round))
                .await;
        } else {
            // The first start: every VF free and managed.
            let list = c
                .list_devices(proto::ListDevicesRequest {})
                .await
                .expect("first list")
                .into_inner();
            for a in vfs.iter() {
                let dev = list
                    .devices
                    .iter()
                    .find(|d| &d.address == a)
                    .unwrap_or_else(|| panic!("{a} missing from the first listing"));
                assert_eq!(dev.state, proto::DeviceState::Free as i32, "{a}");
                checker.model.insert(
                    a.clone(),
                    Expect {
                        owner: None,
                        generation: dev.generation,
                        claim_request: None,
                    },
                );
            }
            checker.high_water = list.host_generation;
            have_model = true;
        }
        if last {
            kill9(&mut d);
            break;
        }
        checker.figures.rounds += 1;

        // The clients, then a kill at a random moment while they work.
        let sent = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for client in 0..CLIENTS {
            tasks.push(tokio::spawn(client_loop(
                socket.clone(),
                client,
                holdings(&checker.model, client),
                vfs.clone(),
                round,
                Rng::new(rng.next()),
                sent.clone(),
            )));
        }
        let delay = if round % 5 == 4 {
            150 + rng.below(400)
        } else {
            5 + rng.below(200)
        };
        tokio::time::sleep(Duration::from_millis(delay)).await;
        kill9(&mut d);
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(30), t)
                .await
                .expect("a client hung after the kill")
                .expect("client task");
        }
        let sent = std::mem::take(&mut *sent.lock().expect("sent"));
        checker.figures.operations += sent.len();
        for s in &sent {
            match s.result {
                Result_::Acked { .. } => checker.figures.acknowledged += 1,
                Result_::Rejected { .. } => checker.figures.rejected += 1,
                Result_::InFlight { .. } => {}
            }
        }
        last_round = sent;
    }

    let f = &checker.figures;
    let summary = format!(
        "crash torture: {} rounds ({} more kills during start), {} operations, {} acknowledged changes, \
         {} rejected, {} in flight at kill ({} applied), lost = {}, half-applied = {}, \
         double owners = {}, generation regressions = {}, final host generation {}, {:.1} s",
        f.rounds,
        f.startup_kills,
        f.operations,
        f.acknowledged,
        f.rejected,
        f.in_flight,
        f.in_flight_applied,
        f.lost,
        f.half_applied,
        f.double_owners,
        f.generation_regressions,
        f.max_host_generation,
        started.elapsed().as_secs_f64()
    );
    println!("{summary}");
    eprintln!("{summary}");
    assert!(
        checker.violations.is_empty(),
        "{} violations, the first: {:#?}\ndaemon log tail:\n{}",
        checker.violations.len(),
        &checker.violations[..checker.violations.len().min(10)],
        log_tail(&log)
    );
    assert!(f.rounds >= 5, "too few rounds ran: {}", f.rounds);
    assert!(f.acknowledged > 0, "no change was ever acknowledged");
    // The kills landed on calls under way, the case GetRequestOutcome must resolve.
    assert!(f.in_flight > 0, "no call was ever in flight at a kill");
    drop(tree);
}
