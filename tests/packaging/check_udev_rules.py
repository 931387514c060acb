#!/usr/bin/env python3
"""Syntax check for udev rules files, for systems whose udevadm has no `verify` (systemd
older than 254, such as Debian 12's 252).

Each rule line is parsed the way udev's rules parser reads it: comma-separated
KEY[{attr}]OP"value" pairs, with the known keys, the operators each key allows and
double-quoted values. Also checked: every GOTO has its LABEL, every rule (and every
commented-out rule) has a comment line directly above it saying why, and values that
name modes and groups are well formed.

Usage: check_udev_rules.py FILE... ; exits 1 and names file:line for each problem.
Running it with --self-test first checks that it rejects known-bad lines.
"""

import re
import sys

# key -> (takes an {attr}?, allowed operators). From udev(7) of systemd 252.
MATCH = {"==", "!="}
ASSIGN = {"=", "+=", "-=", ":="}
KEYS = {
    "ACTION": (False, MATCH),
    "DEVPATH": (False, MATCH),
    "KERNEL": (False, MATCH),
    "KERNELS": (False, MATCH),
    "SUBSYSTEM": (False, MATCH),
    "SUBSYSTEMS": (False, MATCH),
    "DRIVER": (False, MATCH),
    "DRIVERS": (False, MATCH),
    "ATTR": (True, MATCH | {"="}),
    "ATTRS": (True, MATCH),
    "SYSCTL": (True, MATCH | {"="}),
    "ENV": (True, MATCH | {"=", "+=", ":="}),
    "CONST": (True, MATCH),
    "TAG": (False, MATCH | ASSIGN),
    "TAGS": (False, MATCH),
    "TEST": (True, MATCH),
    "PROGRAM": (False, MATCH),
    "RESULT": (False, MATCH),
    "NAME": (False, MATCH | {"=", ":="}),
    "SYMLINK": (False, MATCH | ASSIGN),
    "OWNER": (False, {"=", ":="}),
    "GROUP": (False, {"=", ":="}),
    "MODE": (False, {"=", ":="}),
    "SECLABEL": (True, {"=", "+=", ":="}),
    "RUN": (True, {"=", "+=", ":="}),
    "LABEL": (False, {"="}),
    "GOTO": (False, {"="}),
    "IMPORT": (True, MATCH),
    "OPTIONS": (False, {"=", "+=", ":="}),
}
# Keys whose {attr} is optional (TEST{octal mode}, RUN{type}, IMPORT{type} need one).
ATTR_OPTIONAL = {"TEST", "RUN"}
PAIR = re.compile(r'\s*([A-Z]+)(?:\{([^}]*)\})?\s*(==|!=|\+=|-=|:=|=)\s*"((?:[^"\\]|\\.)*)"\s*')


def parse_rule(line):
    """Returns ([(key, attr, op, value)], error or None)."""
    pairs, pos = [], 0
    while pos < len(line):
        m = PAIR.match(line, pos)
        if not m:
            return pairs, f"cannot parse at column {pos + 1}: {line[pos:pos + 40]!r}"
        key, attr, op, value = m.groups()
        if key not in KEYS:
            return pairs, f"unknown key {key}"
        takes_attr, ops = KEYS[key]
        if op not in ops:
            return pairs, f"operator {op} not allowed for {key}"
        if takes_attr and attr is None and key not in ATTR_OPTIONAL:
            return pairs, f"{key} needs {{attribute}}"
        if not takes_attr and attr is not None:
            return pairs, f"{key} takes no {{attribute}}"
        if key == "MODE" and not re.fullmatch(r"0?[0-7]{3,4}", value):
            return pairs, f"MODE {value!r} is not octal"
        if key in ("GROUP", "OWNER") and not re.fullmatch(r"[a-z_][a-z0-9_-]*|[0-9]+", value):
            return pairs, f"{key} {value!r} is not a user or group name"
        if key == "ACTION" and not re.fullmatch(
            r"(add|remove|change|move|online|offline|bind|unbind)(\|(add|remove|change|move|online|offline|bind|unbind))*",
            value,
        ):
            return pairs, f"ACTION {value!r} is not a known action"
        pairs.append((key, attr, op, value))
        pos = m.end()
        if pos < len(line):
            if line[pos] != ",":
                return pairs, f"expected ',' at column {pos + 1}"
            pos += 1
            if pos >= len(line) or not line[pos:].strip():
                return pairs, "trailing ','"
    if not pairs:
        return pairs, "empty rule"
    return pairs, None


def looks_like_rule(text):
    return bool(re.match(r'\s*[A-Z]+(\{[^}]*\})?\s*(==|!=|\+=|-=|:=|=)\s*"', text))


def check(path):
    problems = []
    labels, gotos = set(), []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    # udev joins lines ending in a backslash.
    for i, raw in enumerate(lines):
        n = i + 1
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            body = line[1:].strip()
            if looks_like_rule(body):  # a commented-out rule must still be valid
                _, err = parse_rule(body)
                if err:
                    problems.append(f"{path}:{n}: commented-out rule: {err}")
                if i == 0 or not lines[i - 1].strip().startswith("#"):
                    problems.append(f"{path}:{n}: commented-out rule without a comment above")
            continue
        if raw.endswith("\\"):
            problems.append(f"{path}:{n}: continuation lines are not used in this package")
            continue
        pairs, err = parse_rule(line)
        if err:
            problems.append(f"{path}:{n}: {err}")
            continue
        if i == 0 or not lines[i - 1].strip().startswith("#"):
            problems.append(f"{path}:{n}: rule without a comment directly above saying why")
        has_match = any(op in MATCH for _, _, op, _ in pairs)
        for key, _, op, value in pairs:
            if key == "LABEL":
                labels.add(value)
            if key == "GOTO":
                gotos.append((n, value))
        if not has_match and not any(k == "LABEL" for k, _, _, _ in pairs):
            problems.append(f"{path}:{n}: rule has no match key: it would apply to every event")
    for n, target in gotos:
        if target not in labels:
            problems.append(f"{path}:{n}: GOTO {target!r} has no LABEL")
    return problems


def self_test():
    bad = [
        'SUBSYSTEM="pci", TAG+="x"',  # assignment to a match-only key
        'SUBSYSTEM=="pci" TAG+="x"',  # missing comma
        'SUBSYSTM=="pci"',  # unknown key
        "SUBSYSTEM==pci",  # unquoted value
        'ATTR=="x"',  # ATTR without {attr}
        'SUBSYSTEM=="vfio", MODE="0669"',  # not octal
        'SUBSYSTEM=="pci", GOTO="nowhere"',  # dangling GOTO (checked per file)
        'ACTION=="ad", TAG+="x"',  # unknown action
        'SUBSYSTEM=="pci",',  # trailing comma
    ]
    good = [
        'SUBSYSTEM=="pci", ATTR{sriov_totalvfs}=="?*", TAG+="hostdevd", ENV{A}="b"',
        'SUBSYSTEM=="pci", TEST=="physfn", TAG+="hostdevd"',
        'LABEL="end"',
    ]
    failures = []
    for line in bad[:-3] + bad[-2:]:
        if parse_rule(line)[1] is None:
            failures.append(f"accepted bad rule {line!r}")
    for line in good:
        err = parse_rule(line)[1]
        if err is not None:
            failures.append(f"rejected good rule {line!r}: {err}")
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".rules", delete=False) as t:
        t.write("# why\n" + bad[6] + "\n")
    if not any("has no LABEL" in p for p in check(t.name)):
        failures.append("accepted a GOTO without LABEL")
    with tempfile.NamedTemporaryFile("w", suffix=".rules", delete=False) as t:
        t.write('SUBSYSTEM=="pci", TAG+="x"\n')
    if not any("without a comment" in p for p in check(t.name)):
        failures.append("accepted a rule without a comment")
    return failures


def main(argv):
    failures = self_test()
    for f in failures:
        print(f"check_udev_rules: self-test: {f}", file=sys.stderr)
    if failures:
        return 2
    problems = []
    for path in argv[1:]:
        problems += check(path)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(f"check_udev_rules: {len(argv) - 1} file(s) OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
