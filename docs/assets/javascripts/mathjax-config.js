// MathJax 3 configuration. MathJax itself is served from assets/mathjax/ (see docs/hooks/site_hooks.py).
//
// * Markdown pages: pymdownx.arithmatex (generic mode) wraps math in elements of class "arithmatex"
//   with \( \) and \[ \] delimiters.
// * Notebook pages: nbconvert leaves $...$ and $$...$$ as text inside .jp-RenderedMarkdown, so those
//   elements and delimiters are processed too.
// Everything else is ignored, so a dollar sign in prose or code output is never read as math.
// MathJax passes "ignored" down to descendants and re-checks it on every element, so the ignore
// pattern must not match elements without a class (Material's common ".*|" would): it names the
// theme's own containers (md-*), and the paragraphs inside a notebook's Markdown cell stay processed.
// Undefined macros and TeX errors must show up as errors (the browser test looks for them), so the
// packages that hide them are removed.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
    packages: { "[-]": ["noundefined", "noerrors"] },
  },
  options: {
    ignoreHtmlClass: "md-.*",
    processHtmlClass: "arithmatex|jp-RenderedMarkdown|jp-MarkdownOutput",
  },
  svg: { fontCache: "global" },
  startup: {
    pageReady() {
      return MathJax.startup.defaultPageReady().then(() => {
        document.documentElement.dataset.mathjax = "typeset";
      });
    },
  },
};
