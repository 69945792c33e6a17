// The cluster view: GET /v1/cluster every 1.5 s while it is shown: the workers, the queue,
// the rejections, routing, and charts of tokens/s and time to first token.
import { getJson } from "./api.js";
import { drawLine } from "./charts.js";

const $ = (id) => document.getElementById(id);
const EVERY_MS = 1500;

export class ClusterView {
  constructor(onUnauthorized) {
    this.onUnauthorized = onUnauthorized;
    this.timer = null;
  }

  start() {
    if (this.timer === null) {
      this.refresh();
      this.timer = setInterval(() => this.refresh(), EVERY_MS);
    }
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
  }

  async refresh() {
    let status;
    try {
      status = await getJson("/v1/cluster");
    } catch (error) {
      if (error.status === 401) { this.stop(); this.onUnauthorized(error.message); }
      $("cluster-updated").textContent = "Not updated: " + (error.message || String(error));
      return;
    }
    this.render(status);
  }

  render(status) {
    $("workers-alive").textContent = String(status.workers_alive);
    $("queue-depth").textContent = `${status.queue.depth} / ${status.queue.max_requests}`;
    const tps = status.workers.filter((w) => w.alive).reduce((sum, w) => sum + w.tokens_per_second, 0);
    $("cluster-tps").textContent = tps.toFixed(1);
    $("rejected-429").textContent = String(status.gateway.rejected_429);
    $("rejected-503").textContent = String(status.gateway.rejected_503);
    const routed = status.gateway.routed;
    $("routed").textContent = ["cache", "load", "shared"].map((r) => routed[r] || 0).join(" / ");
    $("worker-rows").replaceChildren(...status.workers.map(workerRow));
    const pc = status.prefix_cache;
    $("prefix-cache").textContent = pc === null ? "Prefix cache service: not configured (routing by load)."
      : pc.reachable ? `Prefix cache service: ${pc.blocks} blocks indexed across ${pc.workers} workers.`
      : "Prefix cache service: not reachable.";
    drawLine($("chart-tps"), status.history.map((p) => ({ time: p.time, value: p.tokens_per_second })), "line1");
    drawLine($("chart-ttft"), status.history.map((p) => ({ time: p.time, value: p.ttft_seconds })), "line2");
    $("cluster-updated").textContent = "Updated " + new Date(status.time * 1000).toLocaleTimeString();
  }
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function workerRow(w) {
  const tr = document.createElement("tr");
  tr.dataset.workerId = w.worker_id;
  tr.dataset.alive = String(w.alive);
  const kv = document.createElement("td");
  const meter = document.createElement("meter");
  meter.min = 0; meter.max = 1; meter.value = w.kv_cache_usage;
  meter.setAttribute("aria-label", "KV cache usage");
  kv.append(meter, document.createTextNode(` ${(w.kv_cache_usage * 100).toFixed(0)}%`));
  tr.append(
    cell(w.worker_id), cell(`${w.host} / ${w.pid}`),
    cell(w.alive ? "yes" : "no", w.alive ? "alive-yes" : "alive-no"),
    cell(`${w.num_running - w.num_waiting} / ${w.max_num_seqs}`), cell(String(w.num_waiting)),
    cell(String(w.queued_for_it)), kv,
    cell(w.prefix_hit_rate === null ? "–" : `${(w.prefix_hit_rate * 100).toFixed(1)}%`),
    cell(w.tokens_per_second.toFixed(1)), cell(String(w.restarts)), cell(uptime(w.uptime_seconds)),
  );
  return tr;
}

function uptime(seconds) {
  if (!seconds) return "–";
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}
