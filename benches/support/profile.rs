//! Where a running agent's CPU time goes, from `perf`: records its call stacks for a few
//! seconds and sorts each sample into the stage of a request it belongs to.
//!
//! Each sample is counted once, under the first bucket of [`BUCKETS`] whose pattern
//! appears anywhere in its stack (leaf to root), except that every sample taken on the
//! writer thread ([`WRITER_THREAD`]) is the writer's work: `perf` cannot unwind some of
//! its deeper stacks (SQLite's, the kernel's sync) as far as the batch's frame, and those
//! used to fall to "other". A commit made in place on an async worker counts as the
//! writer's work too (its frames name the writer's or the store's functions), and a handler,
//! which runs inside gRPC's unary call, counts as the handler's, leaving to gRPC's stage
//! the rest of that call (decoding the request, encoding the answer). Stacks are unwound
//! from DWARF (release builds keep no frame pointers), so the agent needs its debug
//! information, as the release profile keeps it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// The stages of a request, in the order a sample is tested against them, each with the
/// symbol fragments that mark it.
pub const BUCKETS: &[(&str, &[&str])] = &[
    (
        "the writer's work (decisions, commit, next view)",
        &["writer::Worker::", "store::Store::", "sqlite3"],
    ),
    (
        "the service's handlers",
        &["HostDev>::", "Health>::check", "HealthService"],
    ),
    ("gRPC's framing, decoding and encoding", &["Grpc<T>::unary"]),
    ("the HTTP/2 stream tasks", &["H2Stream"]),
    (
        "the HTTP/2 connection",
        &[
            "h2::proto::connection::Connection",
            "proto::h2::server",
            "h2::server",
        ],
    ),
    ("the runtime's parking and polling", &["park", "epoll_wait"]),
];

/// The name the agent gives its writer thread: each of its samples counts under the first
/// bucket, whatever its stack shows.
pub const WRITER_THREAD: &str = "hostdevd-writer";

/// The name of the bucket for a sample in none of [`BUCKETS`].
pub const OTHER: &str = "other";

/// Parts of the writer's work, each the share of all samples with its pattern anywhere in
/// the stack: nested, not exclusive (the sync is part of the commit). What a batch
/// shares among its changes, and so what group commit divides.
pub const WITHIN: &[(&str, &str)] = &[
    ("of the writer's work, the store's commit", "Store::commit"),
    ("of the commit, the sync of the log", "sqlite3OsSync"),
];

/// The frames through which every system call enters the kernel: the frame just
/// leaf-ward of the first of them names the call (`__x64_sys_futex`, `do_writev`).
const SYSCALL_ENTRY: &[&str] = &["x64_sys_call", "do_syscall_64"];

/// glibc's internal lock, taken or woken (`__lll_lock_wait_private`,
/// `__lll_lock_wake_private`): under the allocator's frames, the malloc arena's lock.
const LIBC_LOCK: &str = "__lll_lock_";

/// Frames of glibc's allocator and of Rust's calls into it.
const ALLOCATOR: &[&str] = &["malloc", "free", "realloc", "memalign", "alloc::alloc::"];

/// Starts `perf record` on process `pid` for `seconds`, writing to `out`. Panics if perf
/// cannot be run at all: a profile asked for must not quietly come back empty.
///
/// `HOSTDEVD_BENCH_PROFILE_EVENT` records another event than the CPU clock, for example a
/// probe on the allocator's `malloc` (made with `perf probe`): the stages' shares are then
/// shares of that event's count (see benches/README.md).
pub fn record(pid: u32, seconds: f64, out: &Path) -> Child {
    let sampling: Vec<String> = match std::env::var("HOSTDEVD_BENCH_PROFILE_EVENT") {
        Ok(event) => vec!["-e".into(), event],
        Err(_) => vec!["-F".into(), "999".into()],
    };
    Command::new("perf")
        .args(["record", "-q"])
        .args(&sampling)
        .args(["--call-graph", "dwarf", "-p"])
        .arg(pid.to_string())
        .arg("-o")
        .arg(out)
        .args(["--", "sleep"])
        .arg(format!("{seconds}"))
        .stdout(Stdio::null())
        .spawn()
        .expect("perf is missing: scripts/deps.sh --profile (linux-perf)")
}

/// Waits for a recording started by [`record`] and checks that it ended well.
pub fn finish(mut perf: Child) {
    let status = perf.wait().expect("wait for perf record");
    assert!(
        status.success(),
        "perf record failed: {status} (as another user than root, see kernel.perf_event_paranoid)"
    );
}

/// What one recording holds: how many samples, the share of them in each bucket (in the
/// order of [`BUCKETS`], then [`OTHER`]) and in each part of [`WITHIN`], the functions
/// most often on top of the stack (self time) and the system calls the samples were in,
/// largest first, and the share spent taking or waking on the malloc arena's lock.
pub struct Profile {
    pub samples: usize,
    pub buckets: Vec<(&'static str, f64)>,
    pub within: Vec<(&'static str, f64)>,
    pub leaves: Vec<(String, f64)>,
    pub syscalls: Vec<(String, f64)>,
    pub malloc_lock: f64,
}

/// Reads a recording through `perf script` and sorts its samples. Inlined frames count
/// (perf resolves them from the debug information, which takes it tens of seconds): the
/// gRPC layer's unary call, for one, is inlined into its caller.
pub fn read(data: &Path) -> Profile {
    let mut script = Command::new("perf")
        .args(["script", "-F", "comm,tid,ip,sym", "-i"])
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("perf script");
    let out = script.stdout.take().expect("perf script's output");
    let mut tally = Tally::default();
    let mut stack: Vec<String> = Vec::new();
    // The thread of the sample being read, from its header.
    let mut comm = String::new();
    for line in BufReader::new(out).lines() {
        let line = line.expect("read perf script's output");
        let frame = line.trim();
        if line.starts_with(char::is_whitespace) && !frame.is_empty() {
            // A frame: "<address> <symbol>", the leaf first.
            let symbol = frame.split_once(' ').map_or("", |(_, s)| s);
            stack.push(symbol.trim_end_matches(" (inlined)").to_string());
        } else {
            // A blank line or the next sample's header ("<comm> <tid>") ends a sample.
            tally.add(&comm, &stack);
            stack.clear();
            if let Some((name, _)) = frame.rsplit_once(char::is_whitespace) {
                comm = name.trim().to_string();
            }
        }
    }
    tally.add(&comm, &stack);
    let status = script.wait().expect("wait for perf script");
    assert!(status.success(), "perf script failed: {status}");
    tally.profile()
}

/// Samples counted so far, by bucket and by leaf function.
#[derive(Default)]
struct Tally {
    samples: usize,
    buckets: HashMap<&'static str, usize>,
    within: HashMap<&'static str, usize>,
    leaves: HashMap<String, usize>,
    syscalls: HashMap<String, usize>,
    malloc_lock: usize,
}

impl Tally {
    fn add(&mut self, comm: &str, stack: &[String]) {
        let Some(leaf) = stack.first() else {
            return;
        };
        self.samples += 1;
        *self.buckets.entry(bucket(comm, stack)).or_default() += 1;
        for (name, pattern) in WITHIN {
            if stack.iter().any(|frame| frame.contains(pattern)) {
                *self.within.entry(name).or_default() += 1;
            }
        }
        *self.leaves.entry(leaf.clone()).or_default() += 1;
        if let Some(call) = syscall(stack) {
            *self.syscalls.entry(call).or_default() += 1;
        }
        let in_lock = stack.iter().any(|frame| frame.contains(LIBC_LOCK));
        if in_lock
            && stack
                .iter()
                .any(|frame| ALLOCATOR.iter().any(|a| frame.contains(a)))
        {
            self.malloc_lock += 1;
        }
    }

    fn profile(self) -> Profile {
        let share = |n: usize| n as f64 / self.samples.max(1) as f64;
        let buckets = BUCKETS
            .iter()
            .map(|(name, _)| *name)
            .chain([OTHER])
            .map(|name| (name, share(self.buckets.get(name).copied().unwrap_or(0))))
            .collect();
        let within = WITHIN
            .iter()
            .map(|(name, _)| (*name, share(self.within.get(name).copied().unwrap_or(0))))
            .collect();
        let largest_first = |counts: HashMap<String, usize>| {
            let mut shares: Vec<(String, f64)> = counts
                .into_iter()
                .map(|(name, n)| (name, share(n)))
                .collect();
            shares.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            shares
        };
        Profile {
            samples: self.samples,
            buckets,
            within,
            malloc_lock: share(self.malloc_lock),
            leaves: largest_first(self.leaves),
            syscalls: largest_first(self.syscalls),
        }
    }
}

/// The system call a sample was taken in, by its kernel function less the usual prefixes
/// (`futex`, `statx`, `writev`), or `None` outside the kernel's entry path.
fn syscall(stack: &[String]) -> Option<String> {
    let entry = stack
        .iter()
        .position(|frame| SYSCALL_ENTRY.iter().any(|e| frame.starts_with(e)))?;
    let call = stack[..entry].last()?;
    let name = ["__x64_sys_", "__do_sys_", "__se_sys_", "ksys_", "do_"]
        .iter()
        .find_map(|prefix| call.strip_prefix(prefix))
        .unwrap_or(call);
    Some(name.to_string())
}

/// The first bucket whose pattern appears in the stack; the first bucket for every sample
/// of the writer thread.
fn bucket(comm: &str, stack: &[String]) -> &'static str {
    if comm == WRITER_THREAD {
        return BUCKETS[0].0;
    }
    BUCKETS
        .iter()
        .find(|(_, patterns)| {
            stack
                .iter()
                .any(|frame| patterns.iter().any(|p| frame.contains(p)))
        })
        .map_or(OTHER, |(name, _)| name)
}
