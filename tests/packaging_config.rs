//! The packaged default config (`packaging/config.toml`, installed as
//! /etc/hostdevd/config.toml) against `src/config.rs`: it parses, the defaults it states
//! are the real defaults, and every key of every config struct is in it.
//!
//! The file lists settings commented out as `#key = value` (and section headers as
//! `#[section]`), prose as `# text`. Uncommenting every setting must give a valid config,
//! so a renamed or retyped key is caught here and not on a hypervisor at startup.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use hostdevd::config::{ApiConfig, Config, LibvirtConfig, LogConfig};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn packaged() -> String {
    let p = root().join("packaging/config.toml");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// A commented-out setting or header: `#key = ...`, `#[x]`, `#[[x]]` (no space after #).
fn is_commented_setting(line: &str) -> bool {
    line.strip_prefix('#')
        .and_then(|r| r.chars().next())
        .is_some_and(|c| c.is_ascii_lowercase() || c == '[')
}

fn uncomment_all(text: &str) -> String {
    text.lines()
        .map(|l| if is_commented_setting(l) { &l[1..] } else { l })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Keys named in the file, set or commented out: `key` of `key = ...` and each part of
/// `[a.b]` / `[[a]]` headers.
fn keys_in(text: &str) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for line in uncomment_all(text).lines() {
        let l = line.trim();
        if l.starts_with('#') || l.is_empty() {
            continue;
        }
        if let Some(h) = l.strip_prefix('[') {
            for part in h.trim_matches(|c| c == '[' || c == ']').split('.') {
                keys.insert(part.trim().to_string());
            }
        } else if let Some((k, _)) = l.split_once('=') {
            keys.insert(k.trim().to_string());
        }
    }
    keys
}

/// Field names of every `Deserialize` struct in a Rust source file (a plain text scan:
/// `pub struct Name {` after a derive naming Deserialize, then `pub field:` lines).
fn deserialize_fields(src: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut derive_seen = false;
    let mut current: Option<String> = None;
    for line in src.lines() {
        let l = line.trim();
        if let Some(name) = &current {
            if l == "}" {
                current = None;
            } else if let Some(rest) = l.strip_prefix("pub ") {
                if let Some((field, _)) = rest.split_once(':') {
                    out.push((name.clone(), field.trim().to_string()));
                }
            }
            continue;
        }
        if l.starts_with("#[derive(") && l.contains("Deserialize") {
            derive_seen = true;
        } else if let Some(rest) = l.strip_prefix("pub struct ") {
            if derive_seen && rest.ends_with('{') {
                current = Some(rest.trim_end_matches('{').trim().to_string());
            }
            derive_seen = false;
        } else if !l.starts_with("#[") && !l.starts_with("///") && !l.is_empty() {
            derive_seen = false;
        }
    }
    out
}

#[test]
fn packaged_config_parses_as_shipped() {
    let cfg = Config::parse(&packaged()).expect("packaging/config.toml must parse");
    // What the package changes from the built-in defaults: the socket's group only.
    let mut want = Config::default();
    want.api.socket_group = Some("hostdevd".into());
    assert_eq!(
        cfg, want,
        "packaging/config.toml sets something besides socket_group"
    );
}

#[test]
fn every_commented_setting_is_valid() {
    let text = uncomment_all(&packaged());
    let cfg = Config::parse(&text)
        .unwrap_or_else(|e| panic!("packaging/config.toml with every setting uncommented: {e}"));
    // The examples are examples; every other stated value is the real default.
    let d = Config::default();
    assert_eq!(cfg.sysfs_root, d.sysfs_root);
    assert_eq!(cfg.dev_root, d.dev_root);
    assert_eq!(cfg.proc_root, d.proc_root);
    assert_eq!(cfg.state_dir, d.state_dir);
    let a = ApiConfig::default();
    assert_eq!(cfg.api.socket, a.socket);
    assert_eq!(cfg.api.socket_mode, a.socket_mode);
    assert_eq!(cfg.api.writer_uids, a.writer_uids);
    assert_eq!(cfg.api.writer_gids, a.writer_gids);
    assert_eq!(cfg.api.watch_buffer, a.watch_buffer);
    assert_eq!(cfg.api.watch_buffer_bytes, a.watch_buffer_bytes);
    assert_eq!(cfg.api.request_log_entries, a.request_log_entries);
    assert_eq!(cfg.api.request_log_in_memory, a.request_log_in_memory);
    assert_eq!(cfg.api.max_watch_streams, a.max_watch_streams);
    assert_eq!(
        cfg.api.max_watch_streams_per_uid,
        a.max_watch_streams_per_uid
    );
    assert_eq!(cfg.api.watch_client_events, a.watch_client_events);
    assert_eq!(cfg.api.watch_client_bytes, a.watch_client_bytes);
    assert!(cfg.api.tcp.is_some(), "the [api.tcp] example is listed");
    assert_eq!(cfg.log, LogConfig::default());
    assert_eq!(cfg.libvirt, LibvirtConfig::default());
    assert!(
        cfg.metrics.listen.is_some(),
        "the [metrics] listen example is listed"
    );
    assert!(!cfg.metrics.allow_remote);
    assert_eq!(cfg.devices.len(), 1, "one [[devices]] example");
}

#[test]
fn every_config_key_is_documented() {
    let src_path: &Path = &root().join("src/config.rs");
    let src = std::fs::read_to_string(src_path).expect("read src/config.rs");
    let fields = deserialize_fields(&src);
    assert!(
        fields.len() >= 15,
        "the scan of src/config.rs found only {fields:?}; has its layout changed?"
    );
    let keys = keys_in(&packaged());
    let missing: Vec<String> = fields
        .iter()
        .filter(|(_, f)| !keys.contains(f))
        .map(|(s, f)| format!("{s}.{f}"))
        .collect();
    assert!(
        missing.is_empty(),
        "packaging/config.toml does not list {missing:?}: add each as `#key = default` \
         with a comment"
    );
}

/// A stop waits for an in-flight VF count change (see the unit's comment), so the unit
/// must not kill the agent before the longest one can end at the default timeouts.
#[test]
fn the_unit_waits_out_a_vf_count_change_at_the_default_timeouts() {
    let p = root().join("packaging/hostdevd.service");
    let unit = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
    let stop: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("TimeoutStopSec="))
        .collect();
    let [value] = stop.as_slice() else {
        panic!("the unit sets TimeoutStopSec= exactly once, found {stop:?}");
    };
    let seconds: u64 = value
        .strip_suffix('s')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("TimeoutStopSec={value}: expected whole seconds, like 420s"));
    let d = Config::default();
    // The autoprobe write, then sriov_numvfs twice (0, then the new count), after the
    // fresh listing of libvirt's domains.
    let longest_ms =
        d.libvirt.timeout_ms + d.hardware.step_timeout_ms + 2 * d.hardware.vf_count_timeout_ms;
    assert!(
        seconds * 1000 > longest_ms,
        "TimeoutStopSec={value} kills a VF count change that may take {longest_ms} ms"
    );
}

/// The bound the packaged file states for `request_log_in_memory` (request_log_entries
/// less a tenth) is the one the agent checks: at it the config is accepted, one over it
/// refused, so an operator who follows the comment gets an agent that starts.
#[test]
fn the_stated_bound_of_the_memory_log_is_the_checked_one() {
    let text = packaged();
    assert!(
        text.contains("At most request_log_entries less a tenth (90000 at the default)"),
        "the comment states the bound"
    );
    let with = |n: u32| {
        Config::parse(&format!(
            "[api]\nrequest_log_entries = 100000\nrequest_log_in_memory = {n}\n"
        ))
    };
    with(90_000).expect("the stated bound is accepted");
    with(90_001).expect_err("one over it is refused");
}
