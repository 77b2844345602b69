"""Checks over the documentation sources and the built site, used by ``tests/test_site.py``.

Plain functions that return lists of problems (empty means fine), so each one can be tested on a
small bad input as well as on the real site.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# ------------------------------------------------------------------------------------------------
# snippet markers and references
# ------------------------------------------------------------------------------------------------
MARKER = re.compile(r"--8<--\s*\[(start|end):([^\]\s]+)\]")
# A snippet line in Markdown: --8<-- "path" or --8<-- "path:section" (possibly indented).
SNIPPET_REF = re.compile(r'^\s*(?:;\s*)?--8<--\s+"([^"]+)"\s*$', re.M)


def marker_problems(text: str, label: str = "<text>") -> list[str]:
    """Unbalanced, duplicated or misordered snippet markers (``--8<--`` start and end lines) of one file."""
    problems = []
    open_at: dict[str, int] = {}
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        for kind, name in MARKER.findall(line):
            if kind == "start":
                if name in open_at:
                    problems.append(f"{label}:{lineno}: [start:{name}] while it is already open")
                elif name in seen:
                    problems.append(f"{label}:{lineno}: section {name} is defined twice")
                open_at[name] = lineno
            else:
                if name not in open_at:
                    problems.append(f"{label}:{lineno}: [end:{name}] without a [start:{name}] before it")
                else:
                    del open_at[name]
                    seen.add(name)
    for name, lineno in open_at.items():
        # pymdownx.snippets would silently include the rest of the file.
        problems.append(f"{label}:{lineno}: [start:{name}] has no [end:{name}]")
    return problems


def sections(text: str) -> set[str]:
    """Names of the complete sections of a file."""
    started, done = set(), set()
    for kind, name in MARKER.findall(text):
        if kind == "start":
            started.add(name)
        elif name in started:
            done.add(name)
    return done


def snippet_refs(markdown: str) -> list[tuple[str, str | None]]:
    """(path, section or None) for every snippet line of a Markdown text."""
    refs = []
    for target in SNIPPET_REF.findall(markdown):
        path, sep, section = target.partition(":")
        refs.append((path, section if sep else None))
    return refs


def reference_problems(markdown: str, root: Path, label: str) -> list[str]:
    problems = []
    for path, section in snippet_refs(markdown):
        file = root / path
        if not file.is_file():
            problems.append(f"{label}: snippet file {path} does not exist")
            continue
        text = file.read_text(encoding="utf-8")
        if section is not None and section not in sections(text):
            problems.append(f"{label}: section {section!r} of {path} does not exist (or has no end marker)")
    return problems


# ------------------------------------------------------------------------------------------------
# links over the built site
# ------------------------------------------------------------------------------------------------
class _PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str, str]] = []  # (tag, attribute, value)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key) and (key == "id" or tag == "a"):
                self.ids.add(a[key])
        for key in ("href", "src"):
            if a.get(key) is not None:
                self.links.append((tag, key, a[key]))
        if tag == "link" and a.get("href") is not None:
            self.links.append((tag, "rel=" + (a.get("rel") or ""), a["href"]))


def parse_page(path: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return parser


def _target_file(site: Path, page: Path, url_path: str) -> Path:
    base = site if url_path.startswith("/") else page.parent
    target = (base / unquote(url_path.lstrip("/"))).resolve()
    if url_path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target


def link_problems(site: Path) -> list[str]:
    """Broken internal links and anchors, and assets that would need the network."""
    site = site.resolve()
    pages = sorted(site.rglob("*.html"))
    parsed = {p.resolve(): parse_page(p) for p in pages}
    problems = []
    for page, parser in parsed.items():
        rel = page.relative_to(site)
        for tag, attr, value in parser.links:
            parts = urlsplit(value)
            if parts.scheme in ("http", "https") or value.startswith("//"):
                # Pages may link out; nothing the page needs to render may come from outside.
                if tag in ("script", "img", "iframe", "source") or (tag == "link" and "stylesheet" in attr):
                    problems.append(f"{rel}: <{tag} {attr}> loads {value} from the network")
                continue
            if parts.scheme in ("mailto", "data", "javascript", "tel") or tag == "link" and "canonical" in attr:
                continue
            if parts.scheme:
                problems.append(f"{rel}: unexpected link scheme in {value}")
                continue
            target = page if not parts.path else _target_file(site, page, parts.path)
            if not target.exists():
                problems.append(f"{rel}: {value} -> {target.relative_to(site) if target.is_relative_to(site) else target} does not exist")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = parsed.get(target.resolve()) or parse_page(target)
                ids = ids.ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{rel}: anchor #{parts.fragment} not found in {target.relative_to(site)}")
    return problems


# ------------------------------------------------------------------------------------------------
# expected display math, from the static HTML
# ------------------------------------------------------------------------------------------------
_ARITHMATEX_BLOCK = re.compile(r'<div class="arithmatex">')
_NB_MARKDOWN = re.compile(r'<div class="jp-RenderedHTMLCommon jp-RenderedMarkdown[^"]*"[^>]*>(.*?)</div>', re.S)


def expected_display_equations(html: str) -> int:
    """Display equations the page's source asks for: arithmatex blocks plus $$ pairs in notebook text."""
    count = len(_ARITHMATEX_BLOCK.findall(html))
    for body in _NB_MARKDOWN.findall(html):
        body = re.sub(r"<(pre|code)\b.*?</\1>", "", body, flags=re.S)
        count += body.count("$$") // 2
    return count


# ------------------------------------------------------------------------------------------------
# layout in the browser: clipped code blocks and tables, and the size of figure labels
# ------------------------------------------------------------------------------------------------
# Runs in the page. Opens every collapsed block and shows every tab, then, for each code block and
# table of the article, finds the boxes between it and the article whose content is wider than they
# are and that clip it (overflow other than visible). Such a box is fine only if it scrolls with the
# cue of extra.css: a visible scrollbar and shadows painted by gradients, the covering ones attached
# to the content ("local"). An element wider than the article with no clipping box spills out of the
# column. The same check then runs with extra.css switched off: what the page would show without it.
LAYOUT_JS = r"""
document.querySelectorAll("details").forEach((e) => { e.open = true; });
const style = document.createElement("style");
style.textContent = ".md-typeset .tabbed-set > .tabbed-content > .tabbed-block { display: block !important; }";
document.head.appendChild(style);
const article = document.querySelector("article.md-content__inner");
function cued(x) {
  const cs = getComputedStyle(x);
  return ["auto", "scroll"].includes(cs.overflowX) && cs.scrollbarWidth !== "none"
    && (cs.backgroundImage.match(/gradient\(/g) || []).length >= 2 && cs.backgroundAttachment.includes("local");
}
function check() {
  const res = {elements: 0, overflowing: 0, cued: 0, uncued: []};
  for (const t of article.querySelectorAll("pre, table")) {
    if (t.parentElement.closest("pre")) continue;
    res.elements++;
    const chain = [];
    const code = t.tagName === "PRE" ? t.querySelector(":scope > code") : null;
    if (code) chain.push(code);
    for (let e = t; e && e !== article; e = e.parentElement) chain.push(e);
    let bad = null, ok = false;
    for (const x of chain) {
      if (x.scrollWidth > x.clientWidth + 1 && getComputedStyle(x).overflowX !== "visible") {
        if (cued(x)) ok = true; else bad = bad || x;
      }
    }
    const spills = !ok && !bad && t.getBoundingClientRect().right > article.getBoundingClientRect().right + 1;
    if (ok || bad || spills) res.overflowing++;
    if (bad || spills) {
      const what = bad ? `${bad.tagName.toLowerCase()}.${bad.className} clips it` : "it spills out of the column";
      res.uncued.push(`${t.tagName.toLowerCase()} "${t.textContent.trim().slice(0, 50)}": ${what}`);
    } else if (ok) res.cued++;
  }
  return res;
}
const imgs = [...article.querySelectorAll("img")].map((i) => ({src: i.currentSrc || i.src, width: i.getBoundingClientRect().width}));
const after = check();
const sheets = [...document.styleSheets].filter((s) => (s.href || "").endsWith("extra.css"));
sheets.forEach((s) => { s.disabled = true; });
const before = check();
sheets.forEach((s) => { s.disabled = false; });
return {articleWidth: article.clientWidth, sheets: sheets.length, after, before, imgs};
"""

_FIGURE_NOTE = re.compile(r"flashattn-figure: smallest-font-pt=([\d.]+) dpi=([\d.]+)")


def figure_font(path: Path) -> tuple[float, float, float] | None:
    """(smallest font in pt, units per inch, natural width in those units) that a figure of this site
    records (see docs/hooks/figures.py and benchmarks/report.py), or None if it records none. The unit
    is the image pixel for a PNG and the point for an SVG (its user unit)."""
    data = path.read_bytes()
    if path.suffix == ".svg":
        text = data.decode("utf-8", errors="replace")
        note, width = _FIGURE_NOTE.search(text), re.search(r'<svg\b[^>]*\bwidth="([\d.]+)pt"', text)
        if not (note and width):
            return None
        return float(note.group(1)), float(note.group(2)), float(width.group(1))
    if path.suffix == ".png":
        from PIL import Image

        with Image.open(path) as im:
            note = _FIGURE_NOTE.search(str(im.info.get("Description", "")))
            if not note:
                return None
            return float(note.group(1)), float(note.group(2)), float(im.width)
    return None


def label_px(font_pt: float, dpi: float, natural_width: float, rendered_width: float) -> float:
    """Height in CSS pixels of text of `font_pt` points in a figure drawn at `dpi` units per inch,
    `natural_width` units wide, and shown `rendered_width` CSS pixels wide."""
    return font_pt * dpi / 72 * rendered_width / natural_width
