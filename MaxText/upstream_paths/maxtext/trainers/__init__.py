"""maxtext.trainers: upstream's path of the trainers."""
