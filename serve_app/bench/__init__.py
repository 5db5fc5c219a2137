"""What `cosyvoice-serve bench` runs, installed with the app: the HTTP load generator (`http_load`), and the rules
every benchmark takes its figures by (`timing`: warm-up, repeats, median and spread, physical bounds) and reports
them with as it runs (`progress`). The benchmark scripts in the repository's `benchmarks/` build on these."""
