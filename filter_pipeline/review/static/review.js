// The review app's only script (served from the package, so the Content-Security-Policy allows no other):
// label buttons and keys y / n / u (one label at a time), and j / k to the next / previous item.
"use strict";

function labelForm() {
  return document.querySelector("form.label-form");
}

// One label at a time: a second press while one is being saved would write a second line, which could land
// first and leave the earlier press as the attempt's label.
let saving = false;

function setSaving(form, on) {
  saving = on;
  form.querySelectorAll("button").forEach((button) => (button.disabled = on));
}

async function sendLabel(success) {
  const form = labelForm();
  if (!form || saving) return;
  const status = form.querySelector(".label-status");
  const note = form.querySelector("input[name=note]").value;
  // (the run and task too: an attempt's dir may lie outside its run's folder)
  const body = { ...JSON.parse(form.dataset.attempt), success: success };
  if (note) body.note = note;
  status.textContent = "saving…";
  setSaving(form, true);
  let response;
  try {
    response = await fetch("/api/labels", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
  } catch (error) {
    status.textContent = "not saved: " + error;
    setSaving(form, false);
    return;
  }
  if (response.status === 201) {
    status.textContent = "saved";  // (the buttons stay off: the page moves on)
    if (form.dataset.after) window.location.href = form.dataset.after;
    else window.location.reload();
    return;
  }
  try {
    status.textContent = "not saved: " + (await response.text());
  } finally {
    setSaving(form, false);
  }
}

// A page the browser restores from its back/forward cache keeps the state it left in: the buttons on again.
window.addEventListener("pageshow", (event) => {
  const form = labelForm();
  if (event.persisted && form) {
    setSaving(form, false);
    form.querySelector(".label-status").textContent = "";
  }
});

function parseSuccess(text) {
  return text === "true" ? true : text === "false" ? false : null;
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("form.label-form button[data-success]");
  if (button) sendLabel(parseSuccess(button.dataset.success));
});

// Enter in the note field would submit the form to the page's own URL: the note lost, another item shown.
document.addEventListener("submit", (event) => {
  const form = event.target.closest("form.label-form");
  if (!form) return;
  event.preventDefault();
  form.querySelector(".label-status").textContent = "choose success, failure or unsure to save the note";
});

document.addEventListener("keydown", (event) => {
  if (event.ctrlKey || event.metaKey || event.altKey || event.repeat) return;
  const tag = (event.target.tagName || "").toLowerCase();
  if (tag === "input" || tag === "textarea" || tag === "select") return;
  const keys = { y: true, n: false, u: null };
  if (event.key in keys) {
    event.preventDefault();
    sendLabel(keys[event.key]);
  } else if (event.key === "j" || event.key === "k") {
    const link = document.getElementById(event.key === "j" ? "next" : "prev");
    if (link) window.location.href = link.href;
  }
});
