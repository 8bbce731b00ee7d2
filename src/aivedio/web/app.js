// The demo page: a prompt, a Generate button, the project's tasks live.
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
  createClient,
  createSession,
  currentSession,
  endSession,
  isFinal,
} from "/static/aivedio-client.js";

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

const $ = (id) => document.getElementById(id);

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function renderState(state, detail) {
  console.debug("aivedio state", state, detail.reason || "");
  const live = $("live");
  live.textContent = STATES[state] || state;
  live.className = `indicator ${state}`;
  live.dataset.state = state;
  if (state === "error") showError(`The stream was refused (${detail.reason}).`);
}

function row(taskId) {
  let li = rows.get(taskId);
  if (li) return li;
  li = document.createElement("li");
  li.dataset.taskId = taskId;
  li.innerHTML =
    '<div class="head"><span class="prompt"></span><span class="status"></span></div>' +
    '<progress max="100" value="0"></progress>' +
    '<div class="foot"><span class="meta"></span> <a class="asset" hidden target="_blank" rel="noopener">open the video</a></div>';
  li.querySelector(".asset").addEventListener("click", openAsset);
  rows.set(taskId, li);
  $("tasks").prepend(li); // newest first
  return li;
}

function renderTask(task) {
  console.debug("aivedio task", task.id, task.task_version, task.status);
  const li = row(task.id);
  li.dataset.status = task.status;
  li.dataset.version = String(task.task_version);
  li.querySelector(".prompt").textContent = prompts.get(task.id) || `task ${task.id.slice(0, 8)}`;
  li.querySelector(".status").textContent = task.stage ? `${task.status} · ${task.stage}` : task.status;
  const bar = li.querySelector("progress");
  if (task.status === "ready") bar.value = 100;
  else if (task.progress === null || task.progress === undefined) bar.removeAttribute("value");
  else bar.value = task.progress;
  bar.hidden = isFinal(task.status) && task.status !== "ready";
  const error = task.error ? ` — ${task.error.message || task.error.code}` : "";
  li.querySelector(".meta").textContent = `v${task.task_version}${error}`;
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

let client = null;

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
    onReset: (reset) => console.debug("aivedio reset", reset.reason, reset.cursor),
  });
  window.aivedio = client; // for the console (and the browser tests)
  $("signout").hidden = false;
  $("signout").addEventListener("click", async () => {
    client.stop();
    await endSession({ baseUrl: "" }).catch(() => {});
    showSetup();
  });
  // Subscribe before submit (seed 004): the stream is open before the first task is created.
  await client.start();
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
