//! Confining every thread of a process to a set of CPUs and letting it go again, for the
//! load rows' context round on one CPU: the same agent and clients with half the
//! machine, to show how the rate of many clients follows the CPUs it is given.
//!
//! The kernel keeps a CPU mask per thread, and a new thread starts with its creator's,
//! so a process is confined by setting the mask of each of its threads (as `taskset -a`
//! does). A thread started while the list is walked may miss it; the walk is repeated
//! until it finds every thread already holding the mask.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// The CPUs this thread may run on (the harness's own, before any confinement).
pub fn allowed() -> CpuSet {
    sched_getaffinity(Pid::from_raw(0)).expect("read this thread's CPU mask")
}

/// The lowest-numbered CPU in `set`, alone.
pub fn first_of(set: &CpuSet) -> CpuSet {
    let cpu = (0..CpuSet::count())
        .find(|&c| set.is_set(c).unwrap_or(false))
        .expect("a CPU mask names at least one CPU");
    let mut one = CpuSet::new();
    one.set(cpu).expect("a CPU number within the mask");
    one
}

/// Gives every thread of process `pid` the mask `set`.
pub fn confine(pid: u32, set: &CpuSet) {
    for _ in 0..10 {
        let mut changed = false;
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's threads");
        for tid in tasks
            .flatten()
            .filter_map(|t| t.file_name().to_str()?.parse().ok())
        {
            let tid = Pid::from_raw(tid);
            // A thread that ended since the listing has no mask to set.
            let Ok(now) = sched_getaffinity(tid) else {
                continue;
            };
            if now != *set && sched_setaffinity(tid, set).is_ok() {
                changed = true;
            }
        }
        if !changed {
            return;
        }
    }
    panic!("process {pid} kept starting threads while its CPU mask was set");
}
