"""CI's smoke run of the README's demo command, as a new user runs it on a fresh machine.

Runs the command (given as argv[1], read from the README) in the clone with no ``AIVEDIO_*_URL``
set, so the demo starts embedded PostgreSQL, NATS and Valkey in a new, empty data folder; reads the
JSON line the demo prints; creates a task through the API; reads the project's SSE stream from the
create response's cursor until that task's ``ready`` event; stops the demo with SIGINT (Ctrl-C) and
expects exit 0; then runs ``aivedio services down`` and checks that every embedded server is gone.

Standard library only: it starts before the demo command has installed anything.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 900.0  # the command installs the package first
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


class SmokeFailed(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(method: str, url: str, key: str, body: dict[str, Any] | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if method == "POST":
        headers["Idempotency-Key"] = "ci-smoke-1"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
        return json.loads(resp.read())


def wait_ready(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SmokeFailed(f"the demo exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise SmokeFailed(f"{url} did not answer 200 within {READY_TIMEOUT_S:.0f} s")


def first_json_line(lines: queue.Queue[str | None], proc: subprocess.Popen[str]) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            raise SmokeFailed(f"the demo command ended (exit {proc.wait()}) before its JSON line")
        print(line, end="", flush=True)
        if line.startswith("{"):
            value: dict[str, Any] = json.loads(line)
            if "api_key" in value:
                return value
    raise SmokeFailed(f"no JSON line from the demo within {START_TIMEOUT_S:.0f} s")


def read_until_ready(port: int, path: str, key: str, cursor: str, task_id: str) -> list[str]:
    """SSE frames from ``cursor`` until ``task_id`` is ready; returns the statuses seen."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=READY_TIMEOUT_S)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}", "Last-Event-ID": cursor})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SmokeFailed(f"SSE answered {resp.status}: {resp.read()[:300]!r}")
    statuses: list[str] = []
    data: list[str] = []
    try:
        while True:
            raw = resp.fp.readline()
            if not raw:
                raise SmokeFailed(f"the stream ended before ready; saw {statuses}")
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and data:
                event = json.loads("\n".join(data))
                data = []
                if event.get("task_id") == task_id:
                    statuses.append(event["status"])
                    if event["status"] in ("failed", "canceled"):
                        raise SmokeFailed(f"the task ended {event['status']}: {statuses}")
                    if event["status"] == "ready":
                        return statuses
    finally:
        conn.close()


def running(pid: int) -> bool:
    """Not gone and not a zombie (an exited server waits for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def services_down(env: dict[str, str], data_dir: Path) -> None:
    state_file = data_dir / "services.json"
    pids = []
    if state_file.exists():
        pids = [r["pid"] for r in json.loads(state_file.read_text()).values() if r.get("pid")]
    done = subprocess.run(
        ["aivedio", "services", "down"],  # noqa: S607
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SmokeFailed(f"`aivedio services down` exited {done.returncode}: {done.stderr}")
    alive = [pid for pid in pids if running(pid)]
    if alive:
        raise SmokeFailed(f"embedded servers still running after `services down`: {alive}")
    print(f"services down: stopped {len(pids)} embedded servers", flush=True)


def smoke(command: str, data_dir: Path, log_path: Path) -> None:
    port, sandbox_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")}
    env |= {
        "AIVEDIO_DATA_DIR": str(data_dir),
        "AIVEDIO_PORT": str(port),
        "AIVEDIO_SANDBOX_URL": f"http://127.0.0.1:{sandbox_port}",
    }
    with log_path.open("w") as log:
        proc = subprocess.Popen(  # noqa: S603 - the README's command, run as a user runs it
            ["bash", "-c", command],  # noqa: S607
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,  # SIGINT to the group, as Ctrl-C in a terminal sends it
        )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        first = first_json_line(lines, proc)
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}/readyz", proc)
        project, key = first["project_id"], first["api_key"]
        created = request(
            "POST",
            f"{base}/v1/projects/{project}/tasks",
            key,
            {
                "provider": "sandbox",
                "model": "sbx-1",
                "prompt": "a cat",
                "params": {"sandbox": {"duration_s": 0.5, "steps": 2}},
            },
        )["task"]
        statuses = read_until_ready(
            port, f"/v1/projects/{project}/events", key, created["cursor"], created["id"]
        )
        print(f"task {created['id']} on its SSE stream: {' -> '.join(statuses)}", flush=True)
        snapshot = request("GET", f"{base}/v1/projects/{project}/tasks/{created['id']}", key)
        if snapshot["task"]["status"] != "ready":
            raise SmokeFailed(f"the snapshot says {snapshot['task']['status']}, not ready")
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise SmokeFailed(f"the demo did not stop within {STOP_TIMEOUT_S:.0f} s") from exc
        if code != 0:
            raise SmokeFailed(f"the demo exited {code} on Ctrl-C")
        print("demo stopped with exit 0", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        services_down(env, data_dir)


def main() -> int:
    command = sys.argv[1]
    print(f"== demo smoke: {command}", flush=True)
    data_dir = Path(tempfile.mkdtemp(prefix="aivedio-ci-demo-"))
    log_path = data_dir.parent / f"{data_dir.name}.log"
    try:
        smoke(command, data_dir, log_path)
    except Exception as exc:  # any failure: say what, and show the demo's log
        print(f"demo smoke FAILED: {exc!r}", file=sys.stderr)
        print(log_path.read_text()[-6000:], file=sys.stderr)
        return 1
    shutil.rmtree(data_dir, ignore_errors=True)
    log_path.unlink(missing_ok=True)
    print("demo smoke passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
