// The task detail of the web console: the task's public event timeline (each event with its seq,
// time and what it changed), its audit trail, and inline playback of the finished video.
//
// The timeline merges two sources by seq: the API's read of the task's events
// (`GET .../tasks/{id}/events`, which gives each event's time) and every event the stream
// delivered while the detail is open (marked "stream": live, or replayed after a reconnect). A
// row the stream delivered keeps that mark, so an exact resume shows as no gap in the "stream"
// rows. The video plays through a fresh signed link (`GET .../playback`, which re-checks the
// caller); when a link has expired, the player asks for a new one once.
import { $, cells, clock } from "/static/console-view.js";

const FIELDS = ["status", "stage", "progress", "asset_id", "error"];

function show(field, value) {
  if (value === null || value === undefined) return "—";
  if (field === "error") return value.code || "error";
  if (field === "asset_id") return String(value).slice(0, 8);
  return String(value);
}

function changedOf(before, after) {
  return FIELDS.filter((f) => JSON.stringify(before ? before[f] ?? null : null) !== JSON.stringify(after[f] ?? null));
}

export function createDetail(client, label) {
  let taskId = null;
  let rows = new Map(); // seq -> {event_id, cursor, task_version, created_at, changed, payload, stream}
  let refreshTimer = null;
  let playingAsset = null;
  let reauthorised = false;

  const panel = $("detail");
  const player = $("player");

  $("detail-close").addEventListener("click", close);
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && taskId !== null) close();
  });
  player.addEventListener("error", async () => {
    // an expired (or otherwise refused) signed link: ask for a fresh one, once
    const task = taskId && client.tasks.get(taskId);
    if (!task || reauthorised) {
      note("The video could not be played.");
      return;
    }
    reauthorised = true;
    await play(task, true);
  });
  player.addEventListener("loadeddata", () => {
    player.dataset.loaded = "1";
    note("");
  });

  function note(text) {
    const box = $("player-note");
    box.textContent = text;
    box.hidden = !text;
  }

  function close() {
    const was = taskId;
    taskId = null;
    rows = new Map();
    panel.hidden = true;
    player.pause();
    player.removeAttribute("src");
    player.hidden = true;
    delete player.dataset.loaded;
    playingAsset = null;
    const opener = was && document.querySelector(`#tasks li[data-task-id="${was}"] .open`);
    if (opener) opener.focus();
  }

  async function open(id) {
    taskId = id;
    rows = new Map();
    playingAsset = null;
    reauthorised = false;
    panel.hidden = false;
    panel.dataset.taskId = id;
    player.hidden = true;
    delete player.dataset.loaded;
    player.removeAttribute("src");
    $("timeline").querySelector("tbody").replaceChildren();
    $("audit").querySelector("tbody").replaceChildren();
    const task = client.tasks.get(id);
    if (task) taskChanged(task);
    $("detail-title").focus();
    await refresh();
  }

  function summary(task) {
    const parts = [
      task.status,
      task.stage,
      task.progress === null || task.progress === undefined ? null : `${task.progress}%`,
      `v${task.task_version}`,
      task.last_event_id ? `event #${task.last_event_id}` : null,
      task.error ? `${task.error.code}: ${task.error.message}` : null,
    ];
    return parts.filter(Boolean).join(" · ");
  }

  function taskChanged(task) {
    if (task.id !== taskId) return;
    $("detail-title").textContent = label(task);
    $("detail-summary").textContent = summary(task);
    panel.dataset.status = task.status;
    if (task.status === "ready" && task.asset && playingAsset !== task.asset.id) play(task, false);
    schedule();
  }

  async function play(task, again) {
    playingAsset = task.asset.id;
    try {
      const url = await client.playbackUrl(task);
      if (taskId !== task.id) return;
      player.hidden = false;
      player.src = url;
      player.dataset.link = again ? "reauthorised" : "signed";
    } catch (error) {
      playingAsset = null;
      note(`Could not get a playback link: ${error.message}`);
    }
  }

  /** An event the stream delivered (live, or replayed from the cursor after a reconnect). */
  function streamed(event, cursor) {
    if (event.task_id !== taskId) return;
    const known = rows.get(event.event_id);
    rows.set(event.event_id, {
      event_id: event.event_id,
      cursor,
      task_version: event.task_version,
      created_at: known ? known.created_at : null,
      changed: known ? known.changed : null,
      payload: event,
      stream: true,
    });
    render();
    schedule();
  }

  function schedule() {
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(refresh, 250);
  }

  async function refresh() {
    const id = taskId;
    if (id === null) return;
    try {
      const [events, audit] = await Promise.all([client.taskEvents(id), client.taskAudit(id)]);
      if (id !== taskId) return;
      for (const e of events) {
        const known = rows.get(e.event_id);
        rows.set(e.event_id, { ...e, stream: known ? known.stream : false });
      }
      render();
      renderAudit(audit);
    } catch (error) {
      // shown again at the next change; a paused stream keeps the board polling
      console.debug("aivedio detail refresh failed", error.message);
    }
  }

  function render() {
    const body = $("timeline").querySelector("tbody");
    const ordered = [...rows.values()].sort((a, b) => a.event_id - b.event_id);
    let previous = null;
    const trs = ordered.map((e) => {
      const tr = document.createElement("tr");
      tr.dataset.seq = String(e.event_id);
      tr.dataset.version = String(e.task_version);
      tr.dataset.via = e.stream ? "stream" : "read";
      const changed = e.changed || changedOf(previous && previous.payload, e.payload);
      const what = changed
        .map((f) => (previous ? `${f}: ${show(f, previous.payload[f])} → ${show(f, e.payload[f])}` : `${f}: ${show(f, e.payload[f])}`))
        .join(", ");
      previous = e;
      return cells(tr, [e.event_id, e.created_at ? clock(e.created_at) : "…", e.task_version, what, e.stream ? "stream" : "read"]);
    });
    body.replaceChildren(...trs);
    panel.dataset.events = String(ordered.length);
  }

  function renderAudit(audit) {
    const body = $("audit").querySelector("tbody");
    const entries = [...audit.ignored_observations, ...audit.unpublished_versions].sort((a, b) =>
      a.received_at < b.received_at ? -1 : 1,
    );
    body.replaceChildren(
      ...entries.map((a) => {
        const tr = document.createElement("tr");
        tr.dataset.outcome = a.outcome;
        tr.dataset.version = a.task_version === null ? "" : String(a.task_version);
        return cells(tr, [clock(a.received_at), a.outcome, a.reason, a.source, a.observed, a.task_version]);
      }),
    );
    $("audit").dataset.entries = String(entries.length);
  }

  return { open, close, taskChanged, streamed };
}
