// Draws every figure embedded in #sparseety-figures with plotly.js (loaded before this script).
(function () {
  "use strict";
  var figures = JSON.parse(document.getElementById("sparseety-figures").textContent);
  var drawn = [];
  Object.keys(figures).forEach(function (id) {
    var el = document.getElementById(id);
    if (!el) { return; }
    var fig = figures[id];
    drawn.push(Plotly.newPlot(el, fig.data, fig.layout, { displaylogo: false, responsive: true }));
  });
  Promise.all(drawn).then(function () {
    document.body.setAttribute("data-charts", String(drawn.length));
  });
})();
