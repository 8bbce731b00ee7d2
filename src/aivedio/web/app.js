// The demo page: a prompt, a Generate button, the project's tasks live.
//
// DEMO ONLY: the project id and the API key come from the URL fragment (`#project=..&key=..`),
// which `aivedio demo` prints; a fragment never reaches a server or its logs. A real deployment
// never gives a browser an API key: its own session endpoint mints the stream token
// (`getStreamToken`) and authorizes the REST calls (`authHeaders`).
import { createClient, isFinal } from "/static/aivedio-client.js";

const STATES = {
  connecting: "connecting…",
  live: "live",
  paused: "live updates paused",
  stopped: "stopped",
  error: "disconnected",
};

const fragment = new URLSearchParams(window.location.hash.slice(1));
const projectId = fragment.get("project");
const apiKey = fragment.get("key");
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

async function main() {
  if (!projectId || !apiKey) {
    $("setup").hidden = false;
    $("generate").disabled = true;
    renderState("stopped", {});
    return;
  }
  client = createClient({
    baseUrl: "",
    projectId,
    apiKey, // demo only, see above
    onTask: renderTask,
    onState: renderState,
    onReset: (reset) => console.debug("aivedio reset", reset.reason, reset.cursor),
  });
  window.aivedio = client; // for the console (and the browser tests)
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
