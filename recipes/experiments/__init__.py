"""The scripts that produced recipes/results/ (one folder per study); see recipes/experiments/README.md."""
