"""What the gateway tells operators: its Prometheus series, the services' scraped ones,
the finished requests, and the dashboard."""
