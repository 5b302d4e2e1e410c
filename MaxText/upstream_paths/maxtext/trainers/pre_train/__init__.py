"""maxtext.trainers.pre_train: upstream's path of the pre-training entry point."""
