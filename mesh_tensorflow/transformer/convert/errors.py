"""The one exception the converter raises for input it cannot convert."""


class ConversionError(ValueError):
  """Input the converter refuses: the message is one line naming the path, variable or gin option."""
