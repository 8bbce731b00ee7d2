// Small shared pieces of the web console: element lookup, the error box, and which commands a
// task's public status allows (the API's rules: `CANCELABLE` and `RETRYABLE` in
// domain/statuses.py, answered 409 `not_cancelable` / `not_retryable` otherwise).

export const $ = (id) => document.getElementById(id);

export function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

const CANCEL_REASONS = {
  cancel_requested: "already asked; waiting for the provider to confirm",
  processing_media: "the provider has finished; its video is being processed",
  ready: "the task has finished",
  failed: "the task has finished",
  canceled: "the task is canceled",
};

/** `{cancel, retry}`: null where the command is allowed, else why it is not. */
export function actionsOf(status) {
  const retryable = status === "failed" || status === "canceled";
  return {
    cancel: CANCEL_REASONS[status] || null,
    retry: retryable ? null : "only a failed or canceled task can be retried",
  };
}

/** `HH:MM:SS.mmm` of an ISO time (local time), or of now. */
export function clock(iso) {
  const at = iso ? new Date(iso) : new Date();
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  return `${pad(at.getHours())}:${pad(at.getMinutes())}:${pad(at.getSeconds())}.${pad(at.getMilliseconds(), 3)}`;
}

/** One table row of text cells. */
export function cells(tr, values) {
  tr.replaceChildren(
    ...values.map((value) => {
      const td = document.createElement("td");
      td.textContent = value === null || value === undefined ? "—" : String(value);
      return td;
    }),
  );
  return tr;
}
