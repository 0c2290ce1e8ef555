// MathJax 3 configuration. Loaded before assets/mathjax/tex-svg.js (served from the
// django-static-mathjax wheel by hooks/offline.py), so MathJax reads it at startup.
//
// Two kinds of source math reach the browser:
//   * arithmatex (generic mode) wraps Markdown math in <span|div class="arithmatex"> as \( \) / \[ \];
//   * notebook markdown cells (mkdocs-jupyter) keep the author's $...$ / $$...$$ inside
//     <div class="jp-RenderedMarkdown ...">.
// MathJax skips an element whose class matches ignoreHtmlClass unless it matches processHtmlClass;
// class-less children inherit their parent's verdict. ".+" therefore ignores every classed element
// of the theme and everything below it, except inside the two math containers (whose <p>, <li> and
// <h1> children carry no class). A dollar sign in prose or code is never mistaken for math.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".+",
    processHtmlClass: "arithmatex|jp-RenderedMarkdown",
  },
  svg: { fontCache: "global" },
};

// Material's instant navigation swaps the page body without reloading scripts; document$ emits
// after each swap. On the first load MathJax may still be starting (it typesets by itself then);
// afterwards, queue a fresh typeset behind whatever MathJax is doing.
document$.subscribe(function () {
  if (typeof MathJax.typesetPromise !== "function") {
    return;
  }
  MathJax.startup.promise = MathJax.startup.promise.then(function () {
    // SVG output keeps shared glyph paths in one hidden <svg>; the swapped body may have lost it.
    MathJax.startup.output.clearFontCache();
    MathJax.typesetClear();
    MathJax.texReset();
    return MathJax.typesetPromise();
  });
});
