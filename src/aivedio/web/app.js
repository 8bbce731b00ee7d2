// The web console: create tasks, watch them live, cancel / retry, a task's timeline and audit
// trail, inline playback, what the connection does, and (with the sandbox provider) chaos.
//
// Credentials: `aivedio demo` prints a link `/#project=<id>&key=<api_key>`. A fragment never
// reaches a server or its logs; the page exchanges the key ONCE for the browser session cookie
// (`POST /v1/sessions`, HttpOnly and SameSite=Strict: no script can read it), forgets the key and
// strips the fragment from the address bar and the history (`history.replaceState`). From then on
// only the cookie authorizes the REST calls and the stream, so a reload keeps working (the page
// asks `GET /v1/sessions/current` for its project) and nothing secret stays in the URL.
//
// Transport: `?transport=websocket` (or the select in the header) streams over the WebSocket;
// the default is SSE.
import {
  callApi,
  createClient,
  createSession,
  currentSession,
  endSession,
} from "/static/aivedio-client.js";
import { $, actionsOf, showError } from "/static/console-view.js";
import { createDetail } from "/static/console-detail.js";
import { createConnectionPanel, createChaosPanel } from "/static/console-panels.js";

const STATES = {
  connecting: "connecting…",
  live: "live",
  paused: "live updates paused",
  stopped: "stopped",
  error: "disconnected",
};
const TRANSPORTS = new Set(["sse", "websocket"]);

const query = new URLSearchParams(window.location.search);
const transport = TRANSPORTS.has(query.get("transport")) ? query.get("transport") : "sse";
const prompts = new Map(); // task id -> prompt, for the tasks this page created
const rows = new Map(); // task id -> <li>

let client = null;
let detail = null;
let connection = null;

function renderState(state, detailInfo) {
  console.debug("aivedio state", state, detailInfo.reason || "");
  const live = $("live");
  live.textContent = STATES[state] || state;
  live.className = `indicator ${state}`;
  live.dataset.state = state;
  if (connection) connection.state(state, detailInfo);
  if (state === "error") showError(`The stream was refused (${detailInfo.reason}).`);
}

function row(taskId) {
  let li = rows.get(taskId);
  if (li) return li;
  li = document.createElement("li");
  li.dataset.taskId = taskId;
  li.innerHTML =
    '<div class="head"><button type="button" class="prompt open"></button><span class="status"></span></div>' +
    '<progress max="100" value="0"></progress>' +
    '<div class="foot"><span class="meta"></span>' +
    ' <a class="asset" hidden target="_blank" rel="noopener">open the video</a></div>' +
    '<div class="actions">' +
    '<button type="button" class="cancel">Cancel</button>' +
    '<button type="button" class="retry">Retry</button>' +
    '<span class="why"></span></div>';
  const why = li.querySelector(".why");
  why.id = `why-${taskId}`;
  for (const name of ["cancel", "retry"]) {
    li.querySelector(`.${name}`).setAttribute("aria-describedby", why.id);
  }
  li.querySelector(".asset").addEventListener("click", openAsset);
  li.querySelector(".open").addEventListener("click", () => detail.open(taskId));
  li.querySelector(".cancel").addEventListener("click", () => command(taskId, "cancel"));
  li.querySelector(".retry").addEventListener("click", () => command(taskId, "retry"));
  rows.set(taskId, li);
  $("tasks").prepend(li); // newest first
  return li;
}

function label(task) {
  return prompts.get(task.id) || task.prompt || `task ${task.id.slice(0, 8)}`;
}

function renderTask(task) {
  console.debug("aivedio task", task.id, task.task_version, task.status);
  const li = row(task.id);
  li.dataset.status = task.status;
  li.dataset.version = String(task.task_version);
  li.dataset.lastEventId = String(task.last_event_id ?? "");
  const open = li.querySelector(".open");
  open.textContent = label(task);
  open.setAttribute("aria-label", `open the detail of ${label(task)}`);
  li.querySelector(".status").textContent = task.stage ? `${task.status} · ${task.stage}` : task.status;
  const bar = li.querySelector("progress");
  if (task.status === "ready") bar.value = 100;
  else if (task.progress === null || task.progress === undefined) bar.removeAttribute("value");
  else bar.value = task.progress;
  bar.hidden = task.status === "failed" || task.status === "canceled";
  bar.setAttribute("aria-label", `progress ${task.progress ?? 0}%`);
  const error = task.error ? ` — ${task.error.message || task.error.code}` : "";
  const seq = task.last_event_id ? ` · event #${task.last_event_id}` : "";
  li.querySelector(".meta").textContent = `v${task.task_version}${seq}${error}`;
  const actions = actionsOf(task.status);
  const why = [];
  for (const name of ["cancel", "retry"]) {
    const button = li.querySelector(`.${name}`);
    const reason = actions[name];
    button.disabled = reason !== null;
    button.title = reason || `${name} this task`;
    button.dataset.reason = reason || "";
    if (reason) why.push(`${name}: ${reason}`);
  }
  li.querySelector(".why").textContent = why.join(" · ");
  const link = li.querySelector(".asset");
  if (task.status === "ready" && task.asset) {
    link.hidden = false;
    link.dataset.assetId = task.asset.id;
    if (!link.getAttribute("href")) {
      // a signed link that expires; a click fetches a fresh one
      link.setAttribute("href", "#");
      client
        .playbackUrl(task)
        .then((url) => url && link.setAttribute("href", url))
        .catch(() => {});
    }
  }
  if (detail) detail.taskChanged(task);
}

async function command(taskId, name) {
  showError("");
  const li = rows.get(taskId);
  const button = li && li.querySelector(`.${name}`);
  if (button) button.disabled = true;
  try {
    const task = name === "cancel" ? await client.cancelTask(taskId) : await client.retryTask(taskId);
    if (task) renderTask(task);
  } catch (error) {
    showError(`Could not ${name} the task: ${error.message}`);
    const task = client.tasks.get(taskId);
    if (task) renderTask(task);
  }
}

async function openAsset(event) {
  event.preventDefault();
  const task = client.tasks.get(event.currentTarget.closest("li").dataset.taskId);
  const view = window.open("", "_blank");
  try {
    const url = await client.playbackUrl(task);
    if (view) view.location = url;
  } catch (error) {
    if (view) view.close();
    showError(`Could not open the video: ${error.message}`);
  }
}

/** The project to show: exchange a key from the fragment for the cookie, or use the cookie. */
async function sessionProject() {
  const fragment = new URLSearchParams(window.location.hash.slice(1));
  let apiKey = fragment.get("key");
  const fromFragment = fragment.get("project");
  if (window.location.hash) {
    // strip the fragment at once: the key must not stay in the address bar or the history
    history.replaceState(history.state, "", window.location.pathname + window.location.search);
  }
  if (apiKey) {
    try {
      const session = await createSession({ baseUrl: "", apiKey, projectId: fromFragment });
      return session.project_id || fromFragment;
    } finally {
      apiKey = null; // forgotten: from now on the HttpOnly cookie is the only credential
    }
  }
  const session = await currentSession({ baseUrl: "" });
  if (session === null) return null;
  return session.project_id || fromFragment;
}

function showSetup() {
  $("setup").hidden = false;
  $("generate").disabled = true;
  renderState("stopped", {});
}

async function main() {
  const picker = $("transport");
  picker.value = transport;
  picker.addEventListener("change", () => {
    const next = new URLSearchParams(window.location.search);
    next.set("transport", picker.value);
    window.location.search = next.toString(); // the cookie keeps the page signed in
  });
  connection = createConnectionPanel(transport);
  let projectId = null;
  try {
    projectId = await sessionProject();
  } catch (error) {
    showError(`Could not start a session: ${error.message}`);
  }
  if (!projectId) {
    showSetup();
    return;
  }
  client = createClient({
    baseUrl: "",
    projectId,
    transport,
    onTask: renderTask,
    onState: renderState,
    onEvent: (event, cursor) => {
      connection.cursor(cursor);
      if (detail) detail.streamed(event, cursor);
    },
    onConnection: (kind, info) => connection.note(kind, info),
    onReset: (reset) => console.debug("aivedio reset", reset.reason, reset.cursor),
  });
  detail = createDetail(client, label);
  window.aivedio = client; // for the console (and the browser tests)
  $("signout").hidden = false;
  $("signout").addEventListener("click", async () => {
    client.stop();
    await endSession({ baseUrl: "" }).catch(() => {});
    showSetup();
  });
  // Subscribe before submit (seed 004): the stream is open before the first task is created.
  await client.start();
  createChaosPanel(client, callApi);
  $("create").addEventListener("submit", async (event) => {
    event.preventDefault();
    const input = $("prompt");
    const prompt = input.value.trim();
    if (!prompt) return;
    const button = $("generate");
    button.disabled = true;
    showError("");
    try {
      const raw = $("params").value.trim();
      const params = raw ? JSON.parse(raw) : {};
      const task = await client.createTask({ provider: "sandbox", model: "sbx-1", prompt, params });
      prompts.set(task.id, prompt);
      renderTask(client.tasks.get(task.id));
      input.value = "";
    } catch (error) {
      showError(`Could not create the task: ${error.message}`);
    } finally {
      button.disabled = false;
    }
  });
  // the view goes away: stop; it comes back from the back/forward cache: resume by cursor
  window.addEventListener("pagehide", () => client.stop());
  window.addEventListener("pageshow", (event) => event.persisted && client.start());
}

main();
