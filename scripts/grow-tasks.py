#!/usr/bin/env python3
"""Grows a stopped berth server's SQLite database to TARGET tasks for the benchmarks.

    scripts/grow-tasks.py DB TARGET [--age-days N]

Copies the database's finished tasks, each with its attempt, under fresh ids until it holds
TARGET tasks. With --age-days, the copies' times are moved N days back (so retention prunes
them). The copies' payloads stay sealed to their template's id, so the server cannot open
them: they are for the backup and retention benchmarks, which never read them.
"""
import argparse, random, sqlite3, uuid

p = argparse.ArgumentParser()
p.add_argument("db")
p.add_argument("target", type=int)
p.add_argument("--age-days", type=float, default=0)
a = p.parse_args()

c = sqlite3.connect(a.db)
c.execute("PRAGMA synchronous=OFF")
cols = [r[1] for r in c.execute("PRAGMA table_info(tasks)")]
acols = [r[1] for r in c.execute("PRAGMA table_info(task_attempts)")]
tasks = c.execute(f"SELECT {','.join(cols)} FROM tasks WHERE state = 'succeeded'").fetchall()
attempts = {r[acols.index("task_id")]: r for r in c.execute(f"SELECT {','.join(acols)} FROM task_attempts")}
tasks = [t for t in tasks if t[cols.index("id")] in attempts]
assert tasks, "no finished task to copy"

# The store keeps times as integers since the epoch; its unit, from a value of it.
sample = tasks[0][cols.index("created_at")]
unit = 1 if sample < 10**11 else 1000 if sample < 10**14 else 10**6 if sample < 10**17 else 10**9
shift = int(a.age_days * 86400 * unit)
time_cols = [i for i, name in enumerate(cols) if name.endswith("_at") and name != "next_attempt_at"]
atime_cols = [i for i, name in enumerate(acols) if name.endswith("_at")]

n = c.execute("SELECT count(*) FROM tasks").fetchone()[0]
seq = c.execute("SELECT coalesce(max(seq), 0) FROM tasks").fetchone()[0]
insert_task = f"INSERT INTO tasks ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})"
insert_attempt = f"INSERT INTO task_attempts ({','.join(acols)}) VALUES ({','.join('?' * len(acols))})"
while n < a.target:
    batch, abatch = [], []
    for _ in range(min(20000, a.target - n)):
        t = list(random.choice(tasks))
        at = list(attempts[t[cols.index("id")]])
        new_id = str(uuid.uuid4())
        seq += 1
        t[cols.index("id")], t[cols.index("seq")], t[cols.index("idempotency_key")] = new_id, seq, None
        at[acols.index("assignment_id")], at[acols.index("task_id")] = str(uuid.uuid4()), new_id
        for i in time_cols:
            if t[i] is not None:
                t[i] -= shift
        for i in atime_cols:
            if at[i] is not None:
                at[i] -= shift
        batch.append(t)
        abatch.append(at)
    c.executemany(insert_task, batch)
    c.executemany(insert_attempt, abatch)
    c.commit()
    n += len(batch)
c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
print(f"{n} tasks, {c.execute('SELECT count(*) FROM task_attempts').fetchone()[0]} attempts")
