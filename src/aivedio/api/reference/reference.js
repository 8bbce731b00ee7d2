// Renders /openapi.json: every operation (grouped by tag) with its credentials, parameters,
// body and answers, then every schema. No dependency; text only goes in through textContent.

const METHODS = ["get", "post", "put", "patch", "delete"];

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

// `code` spans of the document's descriptions become <code>; everything else stays text.
function prose(text, tag = "p") {
  const node = el(tag);
  String(text || "")
    .split("`")
    .forEach((part, i) => node.append(i % 2 ? el("code", {}, part) : part));
  return node;
}

function refName(ref) {
  return ref.split("/").pop();
}

function typeOf(schema) {
  if (!schema || Object.keys(schema).length === 0) return el("span", { class: "type" }, "any");
  if (schema.$ref) {
    const name = refName(schema.$ref);
    return el("a", { href: `#schema-${name}`, class: "type" }, name);
  }
  if (schema.anyOf) {
    const node = el("span", { class: "type" });
    schema.anyOf.forEach((option, i) => {
      if (i) node.append(" | ");
      node.append(typeOf(option));
    });
    return node;
  }
  if (schema.type === "array") {
    return el("span", { class: "type" }, typeOf(schema.items), "[]");
  }
  let text = schema.type || "any";
  if (schema.format) text += ` (${schema.format})`;
  if (schema.enum) text = schema.enum.map((v) => JSON.stringify(v)).join(" | ");
  const limits = [];
  for (const key of ["minimum", "maximum", "minLength", "maxLength", "pattern", "default"]) {
    if (!(key in schema)) continue;
    limits.push(`${key} ${key === "pattern" ? schema[key] : JSON.stringify(schema[key])}`);
  }
  if (limits.length) text += `, ${limits.join(", ")}`;
  return el("span", { class: "type" }, text);
}

function table(head, rows) {
  const body = el("tbody");
  for (const cells of rows) body.append(el("tr", {}, ...cells.map((c) => el("td", {}, c))));
  return el("table", {}, el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))), body);
}

function security(op) {
  const alternatives = op.security || [];
  if (alternatives.length === 0) return prose("Credentials: none.");
  const text = alternatives
    .map((alt) => Object.keys(alt).join(" + ") || "none")
    .join(" or ");
  return prose(`Credentials: ${text}.`);
}

function content(entry) {
  const node = el("span");
  for (const [type, media] of Object.entries(entry.content || {})) {
    node.append(el("code", {}, type), " ", typeOf(media.schema), " ");
  }
  return node;
}

function operation(path, method, op) {
  const section = el("section", { class: "op", id: op.operationId });
  section.append(
    el("h3", {}, el("span", { class: `method ${method}` }, method), " ", el("code", {}, path)),
    prose(op.summary, "strong"),
  );
  if (op.description) section.append(prose(op.description));
  section.append(security(op));
  if (op.parameters && op.parameters.length) {
    const rows = op.parameters.map((p) => [
      el("code", {}, p.name),
      p.in,
      p.required ? "yes" : "no",
      typeOf(p.schema),
      prose(p.description || "", "span"),
    ]);
    section.append(table(["parameter", "in", "required", "type", "meaning"], rows));
  }
  if (op.requestBody) {
    const body = op.requestBody;
    section.append(
      el("p", {}, `Body (${body.required ? "required" : "optional"}): `, content(body)),
    );
    if (body.description) section.append(prose(body.description));
  }
  const rows = Object.entries(op.responses).map(([status, reply]) => [
    el("code", {}, status),
    prose(reply.description, "span"),
    content(reply),
    Object.keys(reply.headers || {}).join(", "),
  ]);
  section.append(table(["status", "when", "body", "headers"], rows));
  return section;
}

function schemaSection(name, schema) {
  const section = el("section", { class: "op", id: `schema-${name}` }, el("h3", {}, name));
  if (schema.description) section.append(prose(schema.description));
  if (schema.enum) section.append(el("p", {}, typeOf(schema)));
  const required = new Set(schema.required || []);
  const rows = Object.entries(schema.properties || {}).map(([field, property]) => [
    el("code", {}, field),
    required.has(field) ? "yes" : "no",
    typeOf(property),
    prose(property.description || "", "span"),
  ]);
  if (rows.length) section.append(table(["field", "required", "type", "meaning"], rows));
  if (schema.additionalProperties === false) {
    section.append(el("p", { class: "muted" }, "No other fields."));
  }
  return section;
}

function render(doc) {
  document.getElementById("title").textContent = `${doc.info.title} ${doc.info.version}`;
  document.getElementById("summary").replaceWith(prose(doc.info.description));
  const main = document.getElementById("reference");
  const toc = document.getElementById("toc");
  main.replaceChildren();
  const groups = new Map(doc.tags.map((tag) => [tag.name, []]));
  for (const [path, item] of Object.entries(doc.paths)) {
    for (const method of METHODS) {
      const op = item[method];
      if (op) groups.get(op.tags[0]).push(operation(path, method, op));
    }
  }
  for (const tag of doc.tags) {
    const sections = groups.get(tag.name);
    if (!sections.length) continue;
    main.append(el("h2", { class: "group", id: `tag-${tag.name}` }, tag.name), prose(tag.description));
    main.append(...sections);
    const links = sections.map((s) => el("li", {}, el("a", { href: `#${s.id}` }, s.id)));
    toc.append(el("h2", {}, tag.name), el("ul", {}, ...links));
  }
  main.append(el("h2", { class: "group", id: "schemas" }, "schemas"));
  for (const [name, schema] of Object.entries(doc.components.schemas)) {
    main.append(schemaSection(name, schema));
  }
  const schemes = Object.entries(doc.components.securitySchemes).map(([name, s]) => [
    el("code", {}, name),
    s.type === "http" ? `${s.scheme} (Authorization)` : `${s.in} ${s.name}`,
    prose(s.description, "span"),
  ]);
  main.append(el("h2", { class: "group", id: "credentials" }, "credentials"));
  main.append(table(["name", "where", "meaning"], schemes));
  document.body.dataset.rendered = "true";
}

async function load() {
  try {
    const response = await fetch("/openapi.json", { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`GET /openapi.json: ${response.status}`);
    render(await response.json());
  } catch (error) {
    document.getElementById("status").textContent = `Could not load the document: ${error}`;
  }
}

load();
