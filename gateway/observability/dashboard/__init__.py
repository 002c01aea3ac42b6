"""The operator's dashboard: `recorder` reads every service at a fixed interval and keeps
a bounded history, `windows` turns cumulative series into figures over a window,
`charts` defines the time series once (for the page, Prometheus and Grafana), and `page`
serves the pages and their data."""
