// Small line charts drawn as SVG elements (no library): one series over time, its last
// value and its largest written beside it. Text goes in with textContent only.
const NS = "http://www.w3.org/2000/svg";
const W = 300, H = 90, LEFT = 34, BOTTOM = 14, TOP = 6;

function el(name, attrs, text) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(v >= 1 ? 2 : 3);
}

// points: [{time, value}] (value null: no data then); draws into the <svg> `svg`.
export function drawLine(svg, points, className = "line1") {
  svg.replaceChildren();
  const values = points.map((p) => p.value).filter((v) => v !== null && v !== undefined);
  const max = Math.max(1e-9, ...values);
  svg.append(el("line", { x1: LEFT, y1: H - BOTTOM, x2: W, y2: H - BOTTOM, class: "axis" }));
  svg.append(el("line", { x1: LEFT, y1: TOP, x2: LEFT, y2: H - BOTTOM, class: "axis" }));
  svg.append(el("text", { x: 2, y: TOP + 8 }, fmt(values.length ? max : null)));
  svg.append(el("text", { x: 2, y: H - BOTTOM }, "0"));
  if (points.length < 2) {
    svg.append(el("text", { x: LEFT + 6, y: H / 2 }, "collecting…"));
    return;
  }
  const t0 = points[0].time, t1 = points[points.length - 1].time;
  const span = Math.max(1, t1 - t0);
  const x = (t) => LEFT + ((t - t0) / span) * (W - LEFT - 2);
  const y = (v) => H - BOTTOM - (v / max) * (H - BOTTOM - TOP);
  // a gap in the data (null) breaks the line
  let run = [];
  const flush = () => {
    if (run.length > 1) svg.append(el("polyline", { points: run.join(" "), class: className }));
    else if (run.length === 1) {  // a lone point between gaps: a dot
      const [cx, cy] = run[0].split(",");
      svg.append(el("circle", { cx, cy, r: 2, class: className + " dot" }));
    }
    run = [];
  };
  for (const p of points) {
    if (p.value === null || p.value === undefined) flush();
    else run.push(x(p.time).toFixed(1) + "," + y(p.value).toFixed(1));
  }
  flush();
  const minutes = Math.round(span / 60);
  svg.append(el("text", { x: LEFT, y: H - 2 }, minutes >= 1 ? `-${minutes} min` : `-${Math.round(span)} s`));
  svg.append(el("text", { x: W - 40, y: H - 2 }, "now " + fmt(values.length ? values[values.length - 1] : null)));
}
