"""maxtext.checkpoint_conversion: upstream's path of the converters."""
