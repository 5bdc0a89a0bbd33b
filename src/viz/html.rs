//! A step table as one self-contained HTML page (no network): the ranks on a circle
//! drawn in SVG, each with its chunks coloured by how many ranks' inputs they hold, the
//! messages of the current round as arrows, and play / step / back controls with a
//! speed slider.
//!
//! The page keeps its state in the DOM for tests and scripts: `body[data-round]` is the
//! round shown, and every chunk is an element `.cell` with `data-rank`, `data-chunk`,
//! `data-value` and `data-contrib`. `page.html#round=K` opens at round `K`.

use super::{StepTable, chunk_name};

/// The table as JSON for the page's script.
fn table_json(t: &StepTable) -> serde_json::Value {
    serde_json::json!({
        "title": format!("{} on {} ranks ({})", t.collective, t.nranks, t.algorithm_label()),
        "nranks": t.nranks,
        "chunks": (0..t.chunks).map(chunk_name).collect::<Vec<_>>(),
        "rounds": t.rounds.iter().map(|r| serde_json::json!({
            "index": r.index,
            "phase": t.phase_of(r),
            "transfers": r.transfers.iter().map(|x| serde_json::json!({
                "from": x.from, "to": x.to, "chunks": x.chunks, "partial": x.partial,
            })).collect::<Vec<_>>(),
            "held": r.held.iter().map(|row| row.iter().map(|c| match c {
                Some(v) => serde_json::json!([v.value, v.contributions()]),
                None => serde_json::Value::Null,
            }).collect::<Vec<_>>()).collect::<Vec<_>>(),
            "changed": r.changed,
        })).collect::<Vec<_>>(),
    })
}

/// The page.
pub fn page(t: &StepTable) -> String {
    let data = table_json(t).to_string().replace("</", "<\\/");
    PAGE.replace(
        "__TITLE__",
        &format!("ferroccl: {} on {} ranks", t.collective, t.nranks),
    )
    .replace("__DATA__", &data)
}

const PAGE: &str = r##"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
  #controls { display: flex; gap: 8px; align-items: center; margin: 8px 0; }
  button { font-size: 14px; padding: 4px 10px; }
  #phase { font-weight: 600; }
  .cell text { font: 11px monospace; text-anchor: middle; dominant-baseline: central; }
  .rank-label { font: 12px sans-serif; font-weight: 600; text-anchor: middle; }
  .arrow { stroke-width: 2; fill: none; marker-end: url(#head); }
  .arrow.partial { stroke: #c0392b; }
  .arrow.final { stroke: #2471a3; }
  .changed rect { stroke: #000; stroke-width: 2; }
  #legend span { display: inline-block; width: 18px; height: 12px; margin: 0 2px; vertical-align: middle; }
</style>
</head>
<body data-round="0">
<h2 id="title"></h2>
<div id="controls">
  <button id="back" title="previous round">&#9664; back</button>
  <button id="play" title="play / pause">&#9654; play</button>
  <button id="step" title="next round">step &#9654;&#9654;</button>
  <label>speed <input id="speed" type="range" min="1" max="10" value="3"></label>
  <span>round <b id="round"></b> / <span id="last"></span></span>
  <span id="phase"></span>
</div>
<div id="legend"></div>
<svg id="view" width="760" height="620" viewBox="0 0 760 620" role="img">
  <defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>
  <g id="arrows"></g><g id="ranks"></g>
</svg>
<p>Each box is one rank; each cell one chunk with the value it holds now (partial sums
that travel in messages included), coloured by how many ranks' inputs it contains.
Red arrows carry partial values, blue ones final values.</p>
<script id="table" type="application/json">__DATA__</script>
<script>
"use strict";
const T = JSON.parse(document.getElementById("table").textContent);
const NS = "http://www.w3.org/2000/svg";
const n = T.nranks, last = T.rounds.length - 1;
const cellW = Math.max(34, Math.min(52, 300 / T.chunks.length)), cellH = 24;
// Up to 8 ranks sit on a circle; more go down the right column and back up the left
// one (still a ring), so the boxes never overlap. The picture scales to fit.
const boxW = cellW * T.chunks.length;
let pos, width, height;
if (n <= 8) {
  const radius = n === 1 ? 0 : 90 + 24 * n;
  const cx = radius + boxW / 2 + 30, cy = radius + 60;
  pos = [...Array(n).keys()].map(r => {
    const a = -Math.PI / 2 + 2 * Math.PI * r / n;
    return [cx + radius * Math.cos(a), cy + radius * Math.sin(a)];
  });
  [width, height] = [2 * cx, 2 * cy];
} else {
  const half = Math.ceil(n / 2), rowH = 56, gap = Math.max(160, boxW * 0.4);
  const left = boxW / 2 + 30, right = left + boxW + gap;
  pos = [...Array(n).keys()].map(r => r < half
    ? [right, 60 + r * rowH]
    : [left, 60 + (n - 1 - r) * rowH]);
  [width, height] = [right + boxW / 2 + 30, 60 + half * rowH + 40];
}
document.getElementById("view").setAttribute("viewBox", `0 0 ${width} ${height}`);
function colour(k) {
  if (!k) return "#f4f4f4";
  const f = n === 1 ? 1 : (k - 1) / (n - 1);
  return `hsl(${140 - 110 * f}, 65%, ${85 - 40 * f}%)`;
}
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}
document.getElementById("title").textContent = T.title;
document.getElementById("last").textContent = last;
document.getElementById("legend").innerHTML = "contributions: " +
  [...Array(n).keys()].map(k => `<span style="background:${colour(k + 1)}"></span>${k + 1}`).join(" ");
const ranksG = document.getElementById("ranks"), arrowsG = document.getElementById("arrows");
const cells = [];
for (let r = 0; r < n; r++) {
  const w = cellW * T.chunks.length, [x, y] = pos[r];
  const g = el("g", { class: "rank", "data-rank": r, transform: `translate(${x - w / 2},${y - cellH / 2})` }, ranksG);
  el("text", { class: "rank-label", x: w / 2, y: -6 }, g).textContent = `rank ${r}`;
  cells.push(T.chunks.map((name, c) => {
    const cg = el("g", { class: "cell", "data-rank": r, "data-chunk": c, transform: `translate(${c * cellW},0)` }, g);
    el("rect", { width: cellW - 2, height: cellH, rx: 3 }, cg);
    el("text", { x: (cellW - 2) / 2, y: cellH / 2 }, cg);
    el("text", { x: (cellW - 2) / 2, y: cellH + 9, fill: "#777" }, cg).textContent = name;
    return cg;
  }));
}
let round = 0, timer = null;
function show(k) {
  round = Math.max(0, Math.min(last, k));
  const R = T.rounds[round];
  document.body.dataset.round = round;
  document.getElementById("round").textContent = round;
  document.getElementById("phase").textContent = R.phase;
  for (let r = 0; r < n; r++) for (let c = 0; c < T.chunks.length; c++) {
    const g = cells[r][c], v = R.held[r][c];
    g.dataset.value = v ? v[0] : "";
    g.dataset.contrib = v ? v[1] : 0;
    g.querySelector("rect").setAttribute("fill", colour(v ? v[1] : 0));
    g.querySelector("text").textContent = v ? v[0] : "·";
    g.classList.toggle("changed", R.changed[r][c]);
  }
  arrowsG.replaceChildren();
  for (const t of R.transfers) {
    const [x1, y1] = pos[t.from], [x2, y2] = pos[t.to];
    const dx = x2 - x1, dy = y2 - y1, len = Math.hypot(dx, dy) || 1, s = 36 / len;
    const mx = (x1 + x2) / 2 - dy * 0.12, my = (y1 + y2) / 2 + dx * 0.12;
    el("path", { class: "arrow " + (t.partial ? "partial" : "final"),
      d: `M${x1 + dx * s},${y1 + dy * s} Q${mx},${my} ${x2 - dx * s},${y2 - dy * s}` }, arrowsG);
    el("text", { x: mx, y: my, "font-size": 11, "text-anchor": "middle" }, arrowsG)
      .textContent = t.chunks.map(c => T.chunks[c]).join(",");
  }
}
function stop() { clearInterval(timer); timer = null; document.getElementById("play").innerHTML = "&#9654; play"; }
function play() {
  if (timer) return stop();
  if (round === last) show(0);
  document.getElementById("play").innerHTML = "&#10074;&#10074; pause";
  timer = setInterval(() => { if (round >= last) stop(); else show(round + 1); },
    2200 / document.getElementById("speed").value);
}
document.getElementById("back").onclick = () => { stop(); show(round - 1); };
document.getElementById("step").onclick = () => { stop(); show(round + 1); };
document.getElementById("play").onclick = play;
document.getElementById("speed").oninput = () => { if (timer) { stop(); play(); } };
const m = /round=(\d+)/.exec(location.hash);
show(m ? Number(m[1]) : 0);
</script>
</body>
</html>
"##;
