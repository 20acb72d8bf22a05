#!/usr/bin/env python3
"""Reports for scripts/bench-reconcilers.sh (not run by hand).

  perf                  stdin: `perf script -F comm,tid,ip,sym | c++filt`; stdout: JSON, the
                        server's samples by reconciler (the root-most frame that names one).
  report OUT CLK_TCK    the runs in OUT: per reconciler, passes, statements and CPU per pass.

Statements are attributed by their text (RULES). A statement several loops run (a task by id,
a release by name) is SHARED: split between its callers by how many calls each makes per unit
it works on, counted from the statements only that caller runs (SPLITS), and the split is
checked against the measured total (printed). Nothing is attributed by guess: what no rule
names is listed as unattributed.
"""
import collections
import glob
import json
import os
import re
import sys

# reconcile.rs is one loop of three sweeps on their own timers: reported apart.
LOOPS = ["deploy", "drift", "readiness", "notify", "retention", "staleness", "leases", "read_backs"]

# (reconciler, pattern on the statement's text with whitespace collapsed). First match wins.
RULES = [
    # reconcile.rs: agent staleness, delivery leases, read-backs.
    ("staleness", r"^UPDATE agents SET status = \$1 WHERE id IN \( SELECT id FROM agents WHERE status"),
    ("leases", r"FROM tasks WHERE state = \S+ AND lease_expires_at <= \$1"),
    ("read_backs", r"FROM tasks p WHERE p\.state = \S+ AND"),
    ("read_backs", r"SELECT rb\.id FROM tasks p JOIN tasks rb"),
    # retention.rs
    ("retention", r"^DELETE FROM tasks WHERE id IN \( ?SELECT t\.id FROM tasks t"),
    ("retention", r"^DELETE FROM events"),
    # notify.rs (the outbox)
    ("notify", r"notifications"),
    # deploy.rs
    ("deploy", r"AS deployment WHERE state IN \(\S+, \S+\) ORDER BY created_at, id LIMIT"),
    ("deploy", r"FROM deployment_targets WHERE deployment_id = \$1"),
    ("deploy", r"FROM deployment_approvals WHERE deployment_id = \$1"),
    ("deploy", r"AS environment WHERE tenant_id = \$1 AND name = \$2$"),
    ("deploy", r"^UPDATE deployments SET state"),
    # drift.rs
    ("drift", r"AS environment WHERE current_release_id IS NOT NULL AND \(\$1::uuid IS NULL OR id > \$1\)"),
    ("drift", r"FROM target_observations WHERE environment_id = \$1"),
    ("drift", r"^INSERT INTO target_observations"),
    ("drift", r"FROM agents WHERE tenant_id = "),
    ("drift", r"FROM ssh_targets"),
    # readiness.rs
    ("readiness", r"AS environment WHERE \(\$1::uuid IS NULL OR id > \$1\) ORDER BY id LIMIT"),
    ("readiness", r"environment_readiness"),
    ("readiness", r"^SELECT id, tenant_id, name, selector, desired_sha"),
    # Shared by deploy (its tasks, its release) and drift (each target's check, the release).
    ("shared:task", r"FROM tasks WHERE tenant_id = \$1 AND id = \$2$"),
    ("shared:task", r"FROM task_attempts WHERE task_id = \$1 ORDER BY assigned_at"),
    ("shared:release", r"FROM releases WHERE tenant_id = \$1 AND name = \$2"),
    # Task creation (the batched insert, its agents' cordon and queue check, the per-agent
    # lock): in this data set only drift creates tasks (every deployment's wave has its tasks,
    # and no target is reachable for a readiness probe).
    ("drift", r"^WITH input AS \(SELECT \* FROM unnest"),
    ("drift", r"^SELECT id, tenant_id, cordoned, CASE WHEN id = ANY"),
    ("drift", r"^SELECT pg_advisory_xact_lock\(hashtextextended\(\$2 \|\| a::text"),
    ("drift", r"FROM agents WHERE id = ANY\(\$1\)$"),
    # The reconciler driver (builds that have one): the database's clock once a pass, and a
    # claim and its release once a page of units claimed in reconciler_claims; split below.
    ("driver:now", r"^SELECT date_trunc\('milliseconds', clock_timestamp\(\)\) AS now"),
    ("driver:claims", r"reconciler_claims"),
    # Not a reconciler: the event sequencer, the pool, transactions.
    ("transaction", r"^(BEGIN|COMMIT|ROLLBACK)"),
    ("sequencer", r"events|audit_pending|audit_log|pg_advisory|pg_notify|LISTEN"),
    ("bench", r"pg_stat_statements"),
]

# The statement each loop runs once a pass (calls / per_pass = passes), for builds without
# berth_reconciler_passes_total.
ENTRIES = {
    "deploy": (r"AS deployment WHERE state IN \(\S+, \S+\) ORDER BY created_at, id LIMIT", 1),
    "drift": (r"AS environment WHERE current_release_id IS NOT NULL AND \(\$1::uuid IS NULL OR id > \$1\)", "pages"),
    "readiness": (r"AS environment WHERE \(\$1::uuid IS NULL OR id > \$1\) ORDER BY id LIMIT", "pages"),
    "notify": (r"^UPDATE notifications SET state = \S+, error_code", 1),
    "retention": (r"^DELETE FROM tasks WHERE id IN \( ?SELECT t\.id FROM tasks t", 1),
    "staleness": (r"^UPDATE agents SET status = \$1 WHERE id IN \( SELECT id FROM agents WHERE status <> \$1", 1),
    "leases": (r"FROM tasks WHERE state = \S+ AND lease_expires_at <= \$1", 1),
    "read_backs": (r"FROM tasks p WHERE p\.state = \S+ AND", 1),
}

# A shared statement's callers, each with the statement that counts its units and the calls
# per unit: deploy reads each advanced deployment's targets once, then each target's task (and
# its attempts) and the release once; drift lists each environment's observations once, then
# each target's last check (and its attempts) and the release once.
SPLITS = {
    "shared:task": {"deploy": (r"FROM deployment_targets WHERE deployment_id = \$1", "per_env"),
                    "drift": (r"FROM target_observations WHERE environment_id = \$1", "per_env")},
    "shared:release": {"deploy": (r"FROM deployment_targets WHERE deployment_id = \$1", 1),
                       "drift": (r"FROM target_observations WHERE environment_id = \$1", 1)},
}

# A frame of a loop's module (base: berth_server::deploy::…; with the driver:
# berth_server::workers::deployments::…, the services it calls sit deeper in the stack).
PERF_RULES = [(loop, re.compile(r"berth_server::(?:\w+::)*?" + pat + r"(?:::|\b)"))
              for loop, pat in [("deploy", "(?:deploy|deployments)"), ("drift", "drift"),
                                ("readiness", "readiness"), ("notify", "notify"),
                                ("retention", "retention")]] + [
    ("staleness", re.compile(r"berth_server::(?:\w+::)*?(?:sweep_agents|\w*staleness)", re.I)),
    ("leases", re.compile(r"berth_server::(?:\w+::)*?(?:sweep_leases|\w*leases)", re.I)),
    ("read_backs", re.compile(r"berth_server::(?:\w+::)*?(?:sweep_read_backs|reconcile::ReadBack\w*)", re.I)),
    ("reconcile", re.compile(r"berth_server::(?:workers::)?reconcile::")),
    ("sequencer", re.compile(r"sequencer")),
    ("pool: ping on return", re.compile(r"return_to_pool")),
    ("runtime: park, timers, epoll", re.compile(r"park_internal|Driver::turn|process_at_time")),
    ("http", re.compile(r"hyper|axum|rustls")),
]


# Units per page of the reconcilers the driver claims in reconciler_claims (the others are
# claimed by their own statement, FOR UPDATE SKIP LOCKED).
CLAIM_PAGE = {"deploy": 200, "drift": 100, "readiness": 100, "retention": 1, "read_backs": 100}

# berth_reconciler_passes_total's names for the loops named otherwise here.
METRIC_NAMES = {"agent_staleness": "staleness", "delivery_leases": "leases", "read_back": "read_backs"}


STORE_RULES = [
    ("readiness", re.compile(r"get_readiness|desired_environment|readiness_environments|put_readiness")),
    ("deploy", re.compile(r"active_deployments|with_parts|record_deployment_step")),
    ("drift", re.compile(r"target_observations|environments_with_release|list_agents")),
    ("driver, no reconciler in the stack", re.compile(r"claim_units|release_units|database_now|workers::driver")),
]


def classify(query):
    for name, pattern in RULES:
        if re.search(pattern, query):
            return name
    return None


def perf_mode():
    counts = collections.Counter()
    others = collections.Counter()
    frames, total = [], 0

    def flush():
        nonlocal frames, total
        if not frames:
            return
        total += 1
        found = fallback = None
        # Root-most frame naming a reconciler: the loop the work was done for, even when a
        # generic driver or a service sits between it and the root. A frame of reconcile.rs
        # that names none of its three sweeps is only a fallback.
        for frame in reversed(frames):
            for name, rx in PERF_RULES[: len(LOOPS)]:
                if rx.search(frame):
                    found = name
                    break
            if found:
                break
            if fallback is None and PERF_RULES[len(LOOPS)][1].search(frame):
                fallback = "reconcile"
        found = found or fallback
        if not found:
            # The driver's generic frames name no reconciler when one's code is inlined into
            # them: the store call the sample is in names it (each is one loop's here).
            for frame in frames:
                for name, rx in STORE_RULES:
                    if rx.search(frame):
                        found = name
                        break
                if found:
                    break
        if not found:
            for frame in reversed(frames):
                for name, rx in PERF_RULES[len(LOOPS) + 1:]:
                    if rx.search(frame):
                        found = name
                        break
                if found:
                    break
        counts[found or "other"] += 1
        if not found:
            named = [f for f in frames if re.search(r"berth_|sqlx|tokio::runtime::task|hyper", f)]
            others[(named[-1] if named else frames[-1])[:140]] += 1
        frames = []

    for line in sys.stdin:
        if not line.strip():
            flush()
        elif line.startswith(("\t", " ")):
            frames.append(line.strip())
        else:
            flush()
    flush()
    json.dump({"samples": total, "by": dict(counts), "other_roots": others.most_common(12)}, sys.stdout)
    print()


def metric(path, name):
    """{label value: number} of `name{name="…"}` samples in a /metrics dump."""
    out = {}
    if not os.path.exists(path):
        return out
    rx = re.compile(r"^" + re.escape(name) + r'\{[^}]*name="([^"]+)"[^}]*\} ([0-9.e+-]+)$')
    for line in open(path):
        m = rx.match(line.strip())
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
    return out


def load_statements(path):
    rows = []
    for line in open(path):
        parts = line.rstrip("\n").split("\t", 3)
        if len(parts) == 4 and parts[0].isdigit():
            rows.append((int(parts[0]), float(parts[1]), int(parts[2]), parts[3]))
    return rows


def report(out, clk):
    machine = open(os.path.join(out, "machine.txt")).read()
    m = re.search(r"ENVS=(\d+) PER_ENV=(\d+)", machine)
    envs, per_env = int(m.group(1)), int(m.group(2))
    pages = envs // 100 + 1  # 100 environments a page, and the short (or empty) last one
    runs = sorted(p[:-4] for p in glob.glob(os.path.join(out, "*.cpu")))
    summary = {}
    for run in runs:
        tag = os.path.basename(run)
        t0, c0, t1, c1 = map(float, open(run + ".cpu").read().split())
        secs = t1 - t0
        cpu_ms = (c1 - c0) / clk * 1000
        pg_ms = 0.0
        start = dict(l.strip().split(":") for l in open(run + ".pg.start") if ":" in l)
        for l in open(run + ".pg.end"):
            if ":" in l:
                pid, ticks = l.strip().split(":")
                if pid in start:
                    pg_ms += (int(ticks) - int(start[pid])) / clk * 1000
        stmts = load_statements(run + ".statements")
        by = collections.defaultdict(lambda: [0, 0.0])
        unattributed = []
        for calls, ms, _, q in stmts:
            c = classify(q)
            if c is None:
                unattributed.append((calls, ms, q))
                c = "unattributed"
            by[c][0] += calls
            by[c][1] += ms
        calls_of = lambda rx: sum(calls for calls, _, _, q in stmts if re.search(rx, q))
        # Shared statements, split by each caller's units.
        split_note = []
        for shared, callers in SPLITS.items():
            total = by.get(shared, [0, 0.0])
            if not total[0]:
                continue
            expect = {}
            for loop, (rx, per) in callers.items():
                expect[loop] = calls_of(rx) * (per_env if per == "per_env" else per)
            n_statements = len([1 for _, _, _, q in stmts if classify(q) == shared])
            want = sum(expect.values()) * max(n_statements, 1)
            split_note.append(f"{shared}: measured {total[0]} calls, callers' units predict {want} "
                              f"({', '.join(f'{k} {v * max(n_statements, 1)}' for k, v in expect.items())})")
            if sum(expect.values()):
                for loop, e in expect.items():
                    share = e / sum(expect.values())
                    by[loop][0] += total[0] * share
                    by[loop][1] += total[1] * share
                del by[shared]
        # Passes.
        units_metric = {}
        u0 = metric(run + ".metrics.start", "berth_reconciler_units_total")
        u1 = metric(run + ".metrics.end", "berth_reconciler_units_total")
        for k in u1:
            units_metric[METRIC_NAMES.get(k, k)] = u1[k] - u0.get(k, 0)
        passes_metric = {}
        m0 = metric(run + ".metrics.start", "berth_reconciler_passes_total")
        m1 = metric(run + ".metrics.end", "berth_reconciler_passes_total")
        for k in m1:
            passes_metric[k] = m1[k] - m0.get(k, 0)
        s0 = metric(run + ".metrics.start", "berth_reconciler_pass_seconds_sum")
        s1 = metric(run + ".metrics.end", "berth_reconciler_pass_seconds_sum")
        pass_secs = {k: s1[k] - s0.get(k, 0) for k in s1}
        passes = {}
        for loop in LOOPS:
            if passes_metric:
                # The head's names: a loop's passes are the sum over the metric names that
                # contain the loop's name (e.g. reconcile's separate sweeps).
                names = [k for k in passes_metric if METRIC_NAMES.get(k, k) == loop]
                passes[loop] = (sum(passes_metric[k] for k in names), "metric " + ",".join(names))
            else:
                rx, per = ENTRIES[loop]
                per = pages if per == "pages" else per
                passes[loop] = (calls_of(rx) / per, f"entry statement / {per}")
        # The driver's statements: the clock by passes; claims by the pages of units claimed
        # (each a claim and a release), pages of CLAIM_PAGE units.
        if passes_metric:
            expect_now = {loop: passes[loop][0] for loop in LOOPS}
            expect_claims = {}
            for loop, page in CLAIM_PAGE.items():
                n = passes[loop][0]
                if n:
                    per_pass = units_metric.get(loop, 0) / n
                    expect_claims[loop] = 2 * n * -(-per_pass // page)
            for shared, expect in (("driver:now", expect_now), ("driver:claims", expect_claims)):
                total = by.get(shared)
                if not total or not sum(expect.values()):
                    continue
                split_note.append(f"{shared}: measured {total[0]} calls, passes and pages predict "
                                  f"{sum(expect.values()):.0f} ({', '.join(f'{k} {v:.0f}' for k, v in expect.items() if v)})")
                for loop, e in expect.items():
                    by[loop][0] += total[0] * e / sum(expect.values())
                    by[loop][1] += total[1] * e / sum(expect.values())
                del by[shared]
        perf = {}
        if os.path.exists(run + ".perf"):
            try:
                perf = json.load(open(run + ".perf"))
            except ValueError:
                perf = {}
        summary[tag] = dict(secs=secs, cpu_ms=cpu_ms, pg_ms=pg_ms, by=by, passes=passes,
                            perf=perf, passes_metric=passes_metric, pass_secs=pass_secs,
                            total=sum(c for c, _, _, _ in stmts))
        print(f"== {tag}: {secs:.1f} s; server CPU {cpu_ms / secs:.1f} ms/s; PostgreSQL backends "
              f"{pg_ms / secs:.1f} ms/s; {summary[tag]['total'] / secs:.0f} statements/s")
        if passes_metric:
            print("   berth_reconciler_passes_total over the window: " +
                  ", ".join(f"{k} {v:.0f}" for k, v in sorted(passes_metric.items())))
            print("   berth_reconciler_pass_seconds_sum over the window: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in sorted(pass_secs.items())))
        for note in split_note:
            print("   " + note)
        samples = perf.get("samples", 0)
        if samples:
            print(f"   perf: {samples} samples: " + ", ".join(
                f"{k} {100 * v / samples:.1f}%" for k, v in sorted(perf["by"].items(), key=lambda kv: -kv[1])))
        print(f"   {'reconciler':<11} {'passes':>7} {'stmts/pass':>11} {'PG ms/pass':>11} {'CPU ms/pass':>12}  passes from")
        for loop in LOOPS:
            n, how = passes[loop]
            calls, ms = by.get(loop, [0, 0.0])
            share = perf.get("by", {}).get(loop, 0) / samples if samples else None
            cpu = f"{cpu_ms * share / n:12.2f}" if share is not None and n else f"{'-':>12}"
            per = lambda v: f"{v / n:11.1f}" if n else f"{'-':>11}"
            print(f"   {loop:<11} {n:7.0f} {per(calls)} {per(ms)} {cpu}  {how}")
        for name in sorted(k for k in by if k not in LOOPS):
            print(f"   not a reconciler: {name}: {by[name][0]:.0f} calls, {by[name][1]:.0f} ms")
        for calls, ms, q in sorted(unattributed, reverse=True)[:15]:
            print(f"   unattributed: {calls} calls, {ms:.0f} ms: {q[:150]}")
    json.dump({k: {kk: (dict(vv) if isinstance(vv, collections.defaultdict) else vv)
                   for kk, vv in v.items()} for k, v in summary.items()},
              open(os.path.join(out, "summary.json"), "w"), indent=1, default=list)


if __name__ == "__main__":
    if sys.argv[1] == "perf":
        perf_mode()
    else:
        report(sys.argv[2], int(sys.argv[3]))
