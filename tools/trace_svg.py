#!/usr/bin/env python3
"""Draws a seqpar Chrome trace (seqpar/core/trace.hpp) as a standalone SVG timeline.

Perfetto shows the same trace interactively; an SVG is for what cannot run a viewer: a page
of documentation, a review, a report. One row per rank: a strip naming each call (forward,
backward), a lane of phase bars under it, and thinner lanes of ring hops in flight, so a
transfer hidden under a compute shows above it while a transfer that was not hidden shows
as a wait. Hover a bar for its name, step and duration.

Usage: python3 tools/trace_svg.py trace.json -o trace.svg [--width 1200] [--title TEXT]
       python3 tools/trace_svg.py --self-test

Python 3 standard library only.
"""

import argparse
import json
import math
import sys
import xml.etree.ElementTree as ET
from xml.sax.saxutils import escape

# One colour per phase (seqpar::phase_name), chosen to tell apart the work (compute: blue),
# the waiting (wait, a2a: warm) and the copies (greys and greens).
PHASE_COLOURS = {
    "pack": "#9ecae1",
    "a2a_in": "#fd8d3c",
    "compute": "#3182bd",
    "merge": "#31a354",
    "wait": "#e6550d",
    "finish": "#a1d99b",
    "a2a_out": "#fdae6b",
    "unpack": "#bdbdbd",
}
HOP_COLOUR = "#756bb1"
CALL_COLOURS = {"forward": "#636363", "backward": "#969696"}

LEFT = 78        # rank labels
RIGHT = 16
CALL_H = 13      # call strip
PHASE_H = 24     # phase lane
HOP_H = 7        # each hop lane
ROW_GAP = 14
FONT = "font-family='DejaVu Sans, Arial, sans-serif'"


def load(path):
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    ranks = {}  # pid -> {"name", "bars": [(tid, event)], "hop_lanes", "labels"}
    for e in events:
        pid = e.get("pid", 0)
        r = ranks.setdefault(pid, {"name": "rank %s" % pid, "bars": [], "hop_lanes": 0, "labels": ""})
        if e.get("ph") == "M":
            args = e.get("args", {})
            if e.get("name") == "process_name":
                r["name"] = str(args.get("name", r["name"]))
            elif e.get("name") == "process_labels":
                r["labels"] = str(args.get("labels", ""))
        elif e.get("ph") == "X":
            tid = int(e.get("tid", 0))
            r["bars"].append((tid, e))
            if tid > 0:
                r["hop_lanes"] = max(r["hop_lanes"], tid)
    return [ranks[k] for k in sorted(ranks)]


def nice_step(span, target):
    """A tick step of 1, 2 or 5 times a power of ten giving about `target` ticks over `span`."""
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def fmt_ms(v):
    return ("%.3f" % v).rstrip("0").rstrip(".") if v else "0"


def is_call(e):
    return e.get("name") == "%s call" % e.get("cat")


def render(ranks, width=1200, title="seqpar timeline"):
    plot_w = width - LEFT - RIGHT
    t_end = max((e["ts"] + e["dur"] for r in ranks for _, e in r["bars"]), default=0.0)  # us
    t_end = t_end if t_end > 0 else 1.0
    step_ms = nice_step(t_end / 1000.0, 10)

    def x(us):
        return LEFT + plot_w * us / t_end

    top = 58  # title and legend
    row_h = [CALL_H + PHASE_H + max(r["hop_lanes"], 1) * (HOP_H + 2) + ROW_GAP for r in ranks]
    axis_y = top + sum(row_h)
    height = axis_y + 34
    out = []
    w = out.append
    w("<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' viewBox='0 0 %d %d' %s font-size='11'>"
      % (width, height, width, height, FONT))
    w("<rect width='100%' height='100%' fill='white'/>")
    w("<text x='%d' y='18' font-size='14' font-weight='bold'>%s</text>" % (LEFT, escape(title)))

    # Legend: the phases that occur, then hops and calls.
    used = {e["name"] for r in ranks for t, e in r["bars"] if t == 0 and not is_call(e)}
    items = [(n, c) for n, c in PHASE_COLOURS.items() if n in used]
    items += [(n, "#cccccc") for n in sorted(used - set(PHASE_COLOURS))]
    if any(r["hop_lanes"] for r in ranks):
        items.append(("hop in flight", HOP_COLOUR))
    calls = {e.get("cat") for r in ranks for _, e in r["bars"] if is_call(e)}
    items += [("%s call" % c, CALL_COLOURS[c]) for c in ("forward", "backward") if c in calls]
    lx = LEFT
    for name, colour in items:
        w("<rect x='%d' y='30' width='12' height='12' fill='%s'/>" % (lx, colour))
        w("<text x='%d' y='40'>%s</text>" % (lx + 16, escape(name)))
        lx += 16 + 7 * len(name) + 18

    # Grid lines under the bars.
    ticks = []
    k = 0
    while k * step_ms * 1000 <= t_end * (1 + 1e-9):
        ticks.append(k * step_ms)
        k += 1
    for t in ticks:
        w("<line x1='%.2f' y1='%d' x2='%.2f' y2='%d' stroke='#e8e8e8'/>" % (x(t * 1000), top - 4, x(t * 1000), axis_y))

    y = top
    for r, h in zip(ranks, row_h):
        name = r["name"] + (" *" if r["labels"] else "")
        label_title = "<title>%s</title>" % escape(r["labels"]) if r["labels"] else ""
        w("<text x='6' y='%d' font-weight='bold'>%s%s</text>" % (y + CALL_H + PHASE_H // 2 + 4, escape(name), label_title))
        if r["hop_lanes"]:
            w("<text x='6' y='%d' fill='#666' font-size='9'>hops</text>" % (y + CALL_H + PHASE_H + HOP_H + 1))
        w("<rect x='%d' y='%d' width='%d' height='%d' fill='#f7f7f7'/>" % (LEFT, y + CALL_H, plot_w, PHASE_H))
        for tid, e in sorted(r["bars"], key=lambda b: (b[0], not is_call(b[1]), b[1]["ts"])):
            x0, x1 = x(e["ts"]), x(e["ts"] + e["dur"])
            bw = max(x1 - x0, 0.6)  # a lap shorter than a pixel still shows
            args = e.get("args", {})
            dur = "%s ms" % fmt_ms(round(e["dur"] / 1000.0, 4))
            if is_call(e):
                tip = "%s #%s: %s" % (e["name"], args.get("call", 0), dur)
                w("<g><title>%s</title><rect x='%.2f' y='%d' width='%.2f' height='%d' fill='%s'/>"
                  % (escape(tip), x0, y, bw, CALL_H - 2, CALL_COLOURS.get(e.get("cat"), "#888")))
                if bw > 60:
                    w("<text x='%.2f' y='%d' fill='white' font-size='10'>%s %s</text>"
                      % (x0 + 4, y + CALL_H - 4, escape(e.get("cat", "")), dur))
                w("</g>")
                continue
            tip = "%s step %s (%s): %s" % (e["name"], args.get("step", 0), e.get("cat", ""), dur)
            if tid == 0:
                fill, by, bh = PHASE_COLOURS.get(e["name"], "#cccccc"), y + CALL_H, PHASE_H
            else:
                fill, by, bh = HOP_COLOUR, y + CALL_H + PHASE_H + 2 + (tid - 1) * (HOP_H + 2), HOP_H
            # A hairline white edge keeps back-to-back bars of one phase (or hops) apart.
            w("<rect x='%.2f' y='%d' width='%.2f' height='%d' fill='%s' stroke='white' stroke-width='0.5'>"
              "<title>%s</title></rect>" % (x0, by, bw, bh, fill, escape(tip)))
            if tid == 0 and bw > 24:
                w("<text x='%.2f' y='%d' fill='white' font-size='9' text-anchor='middle' pointer-events='none'>"
                  "s%s</text>" % (x0 + bw / 2, by + bh // 2 + 3, escape(str(args.get("step", 0)))))
        y += h

    # Time axis.
    w("<line x1='%d' y1='%d' x2='%d' y2='%d' stroke='#333'/>" % (LEFT, axis_y, LEFT + plot_w, axis_y))
    for t in ticks:
        tx = x(t * 1000)
        w("<line x1='%.2f' y1='%d' x2='%.2f' y2='%d' stroke='#333'/>" % (tx, axis_y, tx, axis_y + 5))
        w("<text x='%.2f' y='%d' text-anchor='middle'>%s</text>" % (tx, axis_y + 17, fmt_ms(t)))
    w("<text x='%d' y='%d' text-anchor='end' fill='#444'>ms since each rank's first call</text>"
      % (LEFT + plot_w, axis_y + 30))
    w("</svg>")
    return "\n".join(out) + "\n"


def self_test():
    """Renders a synthetic two-rank trace and checks the SVG: XML, one bar per event."""
    events = []
    for pid in (0, 1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "rank %d" % pid}})
        events.append({"ph": "X", "name": "forward call", "cat": "forward", "pid": pid, "tid": 0, "ts": 0, "dur": 900,
                       "args": {"pass": "forward", "call": 0}})
        t = 0.0
        for s, (name, d) in enumerate([("pack", 50), ("compute", 400), ("wait", 100), ("compute", 350)]):
            events.append({"ph": "X", "name": name, "cat": "forward", "pid": pid, "tid": 0, "ts": t, "dur": d,
                           "args": {"pass": "forward", "step": s}})
            t += d
        events.append({"ph": "X", "name": "hop", "cat": "forward", "pid": pid, "tid": 1, "ts": 50, "dur": 500,
                       "args": {"pass": "forward", "step": 0}})
    ranks = [{"name": "rank %d" % p, "hop_lanes": 1, "labels": "",
              "bars": [(e["tid"], e) for e in events if e["ph"] == "X" and e["pid"] == p]} for p in (0, 1)]
    root = ET.fromstring(render(ranks, 800, "self-test <&>"))
    ns = "{http://www.w3.org/2000/svg}"
    titled = [g for g in root.iter() if g.find(ns + "title") is not None]
    assert len(titled) == 12, len(titled)  # 6 bars per rank, each with its hover title
    assert any("self-test <&>" == (t.text or "") for t in root.iter(ns + "text"))
    print("trace_svg self-test: ok")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", help="Chrome trace JSON written by seqpar::ChromeTrace")
    ap.add_argument("-o", "--output", help="SVG to write (default: the trace's name with .svg)")
    ap.add_argument("--width", type=int, default=1200, help="width in pixels (default 1200)")
    ap.add_argument("--title", default=None, help="title (default: the trace's file name)")
    ap.add_argument("--self-test", action="store_true", help="check the renderer on a built-in trace")
    a = ap.parse_args(argv)
    if a.self_test:
        self_test()
        return 0
    if not a.trace:
        ap.error("a trace file is required")
    ranks = load(a.trace)
    if not ranks:
        print("trace_svg: %s has no events" % a.trace, file=sys.stderr)
        return 1
    out = a.output or (a.trace.rsplit(".", 1)[0] + ".svg")
    svg = render(ranks, max(a.width, 300), a.title or a.trace.replace("\\", "/").rsplit("/", 1)[-1])
    with open(out, "w", encoding="utf-8") as f:
        f.write(svg)
    print("trace_svg: %d ranks, %d bars -> %s" % (len(ranks), sum(len(r["bars"]) for r in ranks), out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
