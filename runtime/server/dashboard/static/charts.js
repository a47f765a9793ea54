// The page's charts, drawn on canvases: the newest point at the right edge, HISTORY points wide.

export const HISTORY = 120; // a minute at two updates a second

// A line of values in [0, max]; null leaves a gap.
export function drawLine(canvas, values, color, max, format) {
  const { ctx, width, height } = surface(canvas);
  const offset = HISTORY - values.length;
  const x = (i) => (width * (i + offset)) / (HISTORY - 1);
  const y = (v) => height - 2 - ((height - 14) * v) / max;
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let drawing = false;
  values.forEach((v, i) => {
    if (v == null) {
      drawing = false;
      return;
    }
    if (drawing) ctx.lineTo(x(i), y(v));
    else ctx.moveTo(x(i), y(v));
    drawing = true;
  });
  ctx.stroke();
  label(ctx, format(max));
}

// Columns of shares that add up to 1, stacked bottom up in ``colors`` order.
export function drawStacked(canvas, rows, colors) {
  const { ctx, width, height } = surface(canvas);
  const step = width / HISTORY;
  const offset = HISTORY - rows.length;
  rows.forEach((parts, i) => {
    let top = height;
    parts.forEach((share, k) => {
      const h = Math.max(share, 0) * height;
      ctx.fillStyle = colors[k];
      ctx.fillRect((i + offset) * step, top - h, Math.ceil(step), h);
      top -= h;
    });
  });
  label(ctx, "100%");
}

// Stacked bars scaled to the tallest; ``marks[i]`` puts a red tick over bar i.
export function drawBars(canvas, rows, colors, marks, format) {
  const { ctx, width, height } = surface(canvas);
  const max = Math.max(1, ...rows.map((parts) => parts.reduce((a, b) => a + b, 0)));
  const step = width / HISTORY;
  const offset = HISTORY - rows.length;
  rows.forEach((parts, i) => {
    const x = (i + offset) * step;
    let top = height - 1;
    parts.forEach((value, k) => {
      const h = ((height - 14) * value) / max;
      ctx.fillStyle = colors[k];
      ctx.fillRect(x + 1, top - h, Math.max(step - 2, 1), h);
      top -= h;
    });
    if (marks && marks[i]) {
      ctx.fillStyle = "#c0392b";
      ctx.fillRect(x, 12, Math.max(step - 1, 2), 3);
    }
  });
  label(ctx, format(max));
}

// The canvas sized to its box at the screen's pixel ratio, cleared and framed.
function surface(canvas) {
  const ratio = window.devicePixelRatio || 1;
  if (!canvas.dataset.height) canvas.dataset.height = canvas.getAttribute("height");
  const height = Number(canvas.dataset.height);
  const width = canvas.clientWidth;
  canvas.style.height = height + "px";
  canvas.width = Math.max(1, Math.round(width * ratio));
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = "#e2e5eb";
  ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
  return { ctx, width, height };
}

function label(ctx, text) {
  ctx.fillStyle = "#6b7385";
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText(text, 4, 11);
}
