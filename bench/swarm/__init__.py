"""The results benchmark: `python -m bench.swarm` trains one language model with several
decentralized-training systems on one emulated network and tabulates what each achieves."""
