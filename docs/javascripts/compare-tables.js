// Comparison tables ("what changed, and why") are prose in every cell: on a phone their three or four
// columns shrink to a word a line. extra.css stacks each row there, its cells one under another; this
// gives every cell its column's name (data-label), which the stacked form shows above the cell.
// Tables opt in by a wrapper: <div class="compare-table" markdown> ... </div>.
document$.subscribe(function () {
  document.querySelectorAll(".md-typeset .compare-table table").forEach(function (table) {
    var names = Array.prototype.map.call(table.querySelectorAll("thead th"), function (th) {
      return th.textContent.trim();
    });
    table.querySelectorAll("tbody tr").forEach(function (row) {
      Array.prototype.forEach.call(row.children, function (cell, n) {
        if (names[n]) {
          cell.setAttribute("data-label", names[n]);
        }
      });
    });
  });
});
