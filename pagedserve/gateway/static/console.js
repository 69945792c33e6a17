// The console's entry point: the tabs, the API key, and the two views.
import { apiKey, getJson, setApiKey } from "./api.js";
import { ClusterView } from "./cluster.js";
import { Playground } from "./playground.js";

const $ = (id) => document.getElementById(id);

function askForKey(reason) {
  $("key-panel").hidden = false;
  if (reason) $("key-reason").textContent = reason + " The key is kept in this tab's session storage only.";
  $("key-input").focus();
}

const playground = new Playground(askForKey);
const cluster = new ClusterView(askForKey);

const tabs = [
  { tab: $("tab-playground"), view: $("view-playground") },
  { tab: $("tab-cluster"), view: $("view-cluster") },
];

function select(index) {
  tabs.forEach(({ tab, view }, i) => {
    const on = i === index;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    view.hidden = !on;
  });
  if (index === 1) cluster.start();
  else cluster.stop();
  const hash = index === 1 ? "#cluster" : "#playground";
  if (location.hash !== hash) history.replaceState(null, "", hash);
}

tabs.forEach(({ tab }, i) => {
  tab.addEventListener("click", () => select(i));
  tab.addEventListener("keydown", (e) => {  // arrow keys move between tabs, as WAI-ARIA's tabs pattern says
    if (e.key !== "ArrowRight" && e.key !== "ArrowLeft") return;
    const next = (i + (e.key === "ArrowRight" ? 1 : tabs.length - 1)) % tabs.length;
    tabs[next].tab.focus();
    select(next);
  });
});

async function loadModel() {
  try {
    const models = await getJson("/v1/models");
    const name = models.data.length ? models.data[0].id : "";
    playground.setModel(name);
    $("model-name").textContent = name;
  } catch (error) {
    if (error.status === 401) askForKey(apiKey() ? "That key was refused." : "This server asks for an API key.");
    else $("model-name").textContent = "(models unavailable: " + error.message + ")";
  }
}

$("key-button").addEventListener("click", () => askForKey(""));
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setApiKey($("key-input").value.trim());
  $("key-input").value = "";
  $("key-panel").hidden = true;
  loadModel();
  if (location.hash === "#cluster") cluster.start();
});
$("key-forget").addEventListener("click", () => { setApiKey(""); $("key-input").value = ""; });

select(location.hash === "#cluster" ? 1 : 0);
loadModel();
