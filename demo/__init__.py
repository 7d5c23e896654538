"""`make demo`: Moshpit SGD with churn on local daemons, training the results benchmark's
byte-level transformer on the Python documentation. demo/model.py and demo/data.py hold the
MLP on sklearn's digits that bench.training compares Moshpit SGD with DDP on."""
