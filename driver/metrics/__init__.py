"""What a run reports: metrics that combine exactly across micro-batches and ranks (`combine`),
metrics.jsonl, TensorBoard scalars and the progress bar (`logger`), PNG plots (`plots`), the terminal
and the libraries' log file (`console`), peak memory per phase (`memory`) and the closing summary
(`summary`).

Interface: `combine.Metrics` / `combine_metrics`; `logger.MetricsLogger` (log(step, values), close());
`plots.plot_metrics(metrics_path, output_dir)`. Depends on nothing else in the driver.
"""
